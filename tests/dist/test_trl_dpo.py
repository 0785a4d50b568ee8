"""TRL's DPOTrainer under sequence_parallel(...) on the 4-rank pool against plain data parallelism on the same
ranks (examples/trl_dpo.py).

Plain: size 1, 4 replicas, 1 pair per micro-batch. Sequence parallel: size P, 4/P replicas, P pairs per
micro-batch: every optimizer step covers the same pairs (tests/dist/test_hf_trainer.py's module doc), TRL's
loss is a mean over pairs, and each metric TRL logs is a mean over pairs or a ratio of token sums, so the
loss, grad_norm, every logged metric and the final parameters must agree to fp32 rounding (1e-5 relative;
rewards/accuracies is a fraction of pairs: exact). The reference model is a separate model with the policy's
initial weights, or TRL's precomputed reference log-probs. Loss types: per-pair ones (sigmoid, IPO, BCO);
"sft" and "aot" reduce over the micro-batch (a token mean, a sort), so 1 pair per micro-batch and P pairs
differ there in plain TRL already; under sequence parallelism they equal plain TRL on the same micro-batch
(every rank holds the micro-batch's whole per-token vectors: ds_seqpar/hf/trl_rows.py)."""
import pytest

from .test_hf_trainer import ds_config, _example, reset_worker_state

import os
import tempfile

BETA = 0.1         # DPOConfig's default
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
           "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy", "num_tokens")


def run_dpo(cfg, micro, reference="model", eval_samples=0, **overrides):
    example = _example("trl_dpo")
    with tempfile.TemporaryDirectory() as out:
        try:
            # TRL's precomputed reference log-probs: world rank 0 writes a cache file beside the data set that the
            # other ranks read, so the data set lives in one directory every rank sees (the pool's shared one)
            data_dir = os.path.join(tempfile.gettempdir(), f"ds_seqpar_dpo_{os.getppid()}_{micro}_{reference}")
            return example.train(cfg, out, per_device_train_batch_size=micro, reference=reference,
                                 eval_samples=eval_samples, data_dir=data_dir, **overrides)
        finally:
            reset_worker_state()


def assert_same_dpo(what, got, want):
    steps, params = got[:2]
    ref_steps, ref_params = want[:2]
    assert [s["step"] for s in steps] == [s["step"] for s in ref_steps] and steps, what
    worst = {}
    for g, w in zip(steps, ref_steps):
        for key in ("loss", "grad_norm", "learning_rate", "rewards/accuracies") + METRICS:
            assert key in g and key in w, (what, key, sorted(g))
            # rewards are beta x (logps - reference logps), a difference of sums: relative to the sums' scale
            scale = BETA * max(abs(w["logps/chosen"]), abs(w["logps/rejected"])) if key.startswith("rewards/") \
                else abs(w[key])
            rel = abs(g[key] - w[key]) / max(scale, 1e-6)
            worst[key] = max(worst.get(key, 0.0), rel)
            still = max(abs(w["rewards/chosen"]), abs(w["rewards/rejected"])) <= 1e-5 * scale
            if key == "rewards/accuracies" and still:
                continue      # the policy is still the reference (lr 0 at the warmup's first step): each reward is
                              # rounding noise around 0 and the accuracy a comparison of ties
            exact = key in ("learning_rate", "rewards/accuracies", "num_tokens")
            assert (g[key] == w[key]) if exact else rel <= 1e-5, (what, key, g["step"], g[key], w[key], w)
    diff = max((params[n] - ref_params[n]).abs().max().item() for n in ref_params)
    assert diff <= 1e-5, f"{what}: final parameters differ from plain data parallelism by {diff:.3e}"
    return worst, diff


_PLAIN = {}


def plain(pool, stage, reference="model", eval_samples=0, **overrides):
    key = (stage, reference, eval_samples, repr(sorted(overrides.items())))
    if key not in _PLAIN:
        _PLAIN[key] = pool.run(run_dpo, ds_config(stage, strategy="zigzag", size=1), 1, reference, eval_samples,
                               **overrides)[0]
    return _PLAIN[key]


EVAL = 8          # eval pairs: 2 eval steps of 4 pairs in both runs (no last-batch remainder)


def assert_same_eval(what, got, want):
    """evaluate(): TRL's eval loss and metrics; the same pairs per eval step in both runs."""
    assert set(got) == set(want) and "eval_loss" in got, (what, sorted(got), sorted(want))
    for key in ("eval_loss",) + tuple(f"eval_{m}" for m in METRICS if m != "num_tokens"):
        assert key in want, (what, key, sorted(want))
        scale = BETA * max(abs(want["eval_logps/chosen"]), abs(want["eval_logps/rejected"])) \
            if key.startswith("eval_rewards/") else abs(want[key])
        assert abs(got[key] - want[key]) <= 1e-5 * max(scale, 1e-6), (what, key, got[key], want[key])


@pytest.mark.parametrize("stage,sp,reference,overrides", [
    (2, dict(strategy="zigzag", size=2), "model", {"eval_samples": EVAL}),
    (2, dict(strategy="ulysses", size=4), "precompute", {}),
    (2, dict(strategy="striped", size=2), "model", {"loss_type": ["ipo", "bco_pair"], "loss_weights": [1.0, 0.5]}),
    (3, dict(strategy="ring", size=2), "model", {}),
], ids=["zigzag-zero2", "ulysses4-precompute", "striped-ipo-bco", "ring-zero3"])
def test_dpo_trainer_equals_plain_data_parallelism(pool, stage, sp, reference, overrides):
    """With the zigzag case also TRL's evaluation (8 pairs), sequence-parallel, against plain's."""
    what = f"DPOTrainer {sp} ZeRO-{stage} {reference} {overrides}"
    got = pool.run(run_dpo, ds_config(stage, **sp), sp["size"], reference, **overrides)[0]
    want = plain(pool, stage, reference, **overrides)
    assert_same_dpo(what, got, want)
    if overrides.get("eval_samples"):
        assert_same_eval(what, got[2], want[2])


def test_row_alignment_keeps_positions_and_refuses_inner_padding():
    """Left-padded rows (GRPO's prompts) are rotated so the real tokens lead, each keeping its plain position id,
    and rotated back exactly; inner zeros and a target on a left pad are refused by name."""
    import torch
    from ds_seqpar.hf.checks import UnsupportedModelError
    from ds_seqpar.hf.trl_rows import align_rows, kept_positions, rotate
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]])
    labels = torch.where(mask.bool(), torch.arange(6).expand(3, 6), torch.full_like(mask, -100))
    labels[:, :3] = -100                                   # prompt tokens: no targets (as TRL labels them)
    kwargs = {"attention_mask": mask}
    lead = align_rows(kwargs, labels, "GRPOTrainer")
    assert "attention_mask" not in kwargs and lead.tolist() == [2, 0, 1]
    ids = torch.arange(18).view(3, 6)
    turned = rotate(ids, lead)
    assert turned.tolist() == [[2, 3, 4, 5, 0, 1], [6, 7, 8, 9, 10, 11], [13, 14, 15, 16, 17, 12]]
    assert torch.equal(rotate(turned, -lead), ids)
    assert torch.equal(rotate(mask, lead)[:, :3], torch.ones(3, 3, dtype=mask.dtype))    # real tokens lead
    pos = kept_positions(lead, 6)
    assert pos.tolist() == [[2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6]]
    assert align_rows({"attention_mask": torch.ones(2, 4)}, labels[:2, :4], "X") is None     # no padding at all
    refusals = []
    for bad, lab in ((torch.tensor([[1, 0, 1, 1]]), torch.full((1, 4), -100)),
                     (torch.tensor([[0, 1, 1, 1]]), torch.tensor([[-100, 5, -100, -100]]))):
        try:
            align_rows({"attention_mask": bad}, lab, "DPOTrainer")
        except UnsupportedModelError as err:
            refusals.append(str(err))
    assert len(refusals) == 2 and all("DPOTrainer" in m for m in refusals), refusals
    assert "inner padding" in refusals[0] and "-100" in refusals[1]
