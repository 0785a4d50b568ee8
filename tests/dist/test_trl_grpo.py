"""TRL's GRPOTrainer under sequence_parallel(...) on the 4-rank pool against plain data parallelism with as many
processes as there are replicas (examples/trl_grpo.py).

Sequence parallel: size 2 on 4 ranks, 2 replicas. Plain: size 1 on the 2-rank pool (tests/conftest.py: 2 processes): the
same data-parallel degree, so each replica reads the prompts plain process d reads and is seeded as TRL seeds it
(seed + d). Every rank of a replica then samples the plain process's completions (decoding over the
sequence-sharded KV cache: the applied model's generate, left-padded prompts) (compared through the logged
completion lengths and the rewards, which are functions of them), and every loss, advantage and metric TRL
logs is a function of per-token log-probs that the plain run computes in one process: equal to fp32 rounding
(1e-5 relative to the value's scale; counts and lengths exactly), as are the final parameters."""
import os
import tempfile

import pytest

from .test_hf_trainer import ds_config, _example, reset_worker_state

EXACT = ("num_tokens", "learning_rate", "frac_reward_zero_std", "epoch", "step")   # and completions/*: counts
TIMING = ("step_time",)                # TRL's wall clock
REQUIRED = ("loss", "grad_norm", "reward", "reward_std", "entropy", "completions/mean_length", "num_tokens")


def run_grpo(cfg, **options):
    """On every rank: one run; rank 0 returns (steps, params, how many generate calls decoded over the sharded
    cache)."""
    from ds_seqpar.hf import generate
    example = _example("trl_grpo")
    if options.get("reference"):      # a directory every rank of both pools sees (the model is the same)
        options["reference"] = os.path.join(tempfile.gettempdir(), f"ds_seqpar_grpo_model_{os.getppid()}")
    calls, sharded = [], generate.sharded_generate

    def counted(*args, **kwargs):
        calls.append(1)
        return sharded(*args, **kwargs)
    generate.sharded_generate = counted
    with tempfile.TemporaryDirectory() as out:
        try:
            result = example.train(cfg, out, **options)
        finally:
            generate.sharded_generate = sharded
            reset_worker_state()
    return None if result is None else (*result, len(calls))


def initial_parameters():
    example = _example("trl_dpo")
    return {n: p.detach().clone() for n, p in example.model().named_parameters()}


_PLAIN = {}


def plain(pool2, stage, **options):
    """Plain data parallelism on the 2-rank pool (the conftest's ``pool2``): 2 processes, 2 replicas' worth."""
    key = (stage, repr(sorted(options.items())))
    if key not in _PLAIN:
        _PLAIN[key] = pool2.run(run_grpo, ds_config(stage, strategy="zigzag", size=1), **options)[0]
    return _PLAIN[key]


def assert_same_grpo(what, got, want, extra=()):
    steps, params = got[:2]
    ref_steps, ref_params = want[:2]
    assert [s["step"] for s in steps] == [s["step"] for s in ref_steps] and steps, what
    compared = set()
    for g, w in zip(steps, ref_steps):
        for key in [k for k in w if k not in TIMING]:       # every metric TRL logged (a step reusing rollouts: fewer)
            assert key in g, (what, key, sorted(g))
            compared.add(key)
            if key in EXACT or key.startswith("completions/"):
                assert g[key] == w[key], (what, key, g["step"], g[key], w[key])
            else:
                assert abs(g[key] - w[key]) <= 1e-5 * max(abs(w[key]), 1e-3), (what, key, g["step"], g[key], w[key])
    assert set(REQUIRED + tuple(extra)) <= compared, (what, sorted(set(REQUIRED + tuple(extra)) - compared))
    # Adam normalises each gradient entry, so an entry whose gradient cancels to rounding level moves by up to lr
    # in either run: the final parameters are compared by their update from the initial ones, in norm
    start = initial_parameters()
    for name, want_p in ref_params.items():
        moved = (want_p - start[name]).norm().item()
        diff = (params[name] - want_p).norm().item()
        assert diff <= 1e-3 * max(moved, 1e-6), (f"{what}: {name} differs from plain data parallelism by {diff:.3e} "
                                                 f"after an update of {moved:.3e}")


CASES = [
    (2, dict(strategy="zigzag", size=2), {}),
    (3, dict(strategy="ulysses", size=2), {"loss_type": "dapo", "reference": "saved"}),
    (2, dict(strategy="striped", size=2), {"loss_type": "dr_grpo", "steps_per_generation": 4,
                                          "top_entropy_quantile": 0.5}),
    (2, dict(strategy="ring", size=2), {"trainer": "rloo", "top_k": 20, "top_p": 0.9, "temperature": 0.8}),
]


@pytest.mark.parametrize("stage,sp,options", CASES, ids=["zigzag-grpo-zero2", "ulysses-dapo-kl-zero3",
                                                          "striped-drgrpo-oldpolicy", "ring-rloo-topk-topp"])
def test_grpo_trainer_equals_plain_data_parallelism(pool, pool2, stage, sp, options):
    """grpo (the default); dapo with the reference model's KL at ZeRO-3; dr_grpo with the old policy's log-probs
    (steps_per_generation 4 > gradient_accumulation_steps 2: each generation batch serves two optimizer steps)
    and the entropy mask (top_entropy_quantile: a quantile over the replicas' completion tokens); TRL's
    RLOOTrainer (the same rollout path) sampling with top-k, top-p and a temperature."""
    what = f"GRPOTrainer {sp} ZeRO-{stage} {options}"
    got = pool.run(run_grpo, ds_config(stage, **sp), **options)[0]
    want = plain(pool2, stage, **options)
    assert got[2] >= 1 and want[2] == 0, f"{what}: the rollouts did not decode over the sharded cache ({got[2]})"
    assert_same_grpo(what, got, want, extra=("kl",) if options.get("reference") else ())
