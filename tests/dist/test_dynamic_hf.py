"""Hugging Face models under dynamic data-sequence groups, on 4 ranks through a real DeepSpeed engine:
apply_sequence_parallel(model, dsp) routes each micro-batch's attention (and a hybrid's linear
layers) to the group it runs on, and one step over a global batch that uses groups of 1, 2 and 4
ranks and an empty micro-batch gives the loss (token-level mean of the batch, from the model's own
``model(**batch).loss``) and every parameter gradient of the unsharded model run document by
document. Bounds derived as in the other HF tests: K x the float32-vs-float64 error of the unsharded
model (K = 5 for the dense model, 10 with a floor of 1e-5 of the largest entry for a hybrid, whose
linear ops compute in float32 whatever the input: tests/zoo/hybrids.py)."""
import contextlib

import pytest
import torch
import torch.nn.functional as F

from ..zoo.hybrids import build, hybrid_config
from ..hf_models import tiny_model
from ..zoo.decoders import _worst

T = 16
# at 4 ranks and T = 16: 50 tokens need 4 ranks, 17-30 need 2, the rest fit on one (an empty micro-batch)
LENGTHS = [50, 30, 17, 10, 13, 2, 2, 14]
BOUND = {"llama": dict(k=5.0, floor=1e-6), "qwen3_5_text": dict(k=10.0, floor=1e-5)}
# (model, sequence_parallel keys, ZeRO stage): the dense model on a token-splitting and a head-splitting
# strategy and the 2D hybrid (2 x 2 on the 4-rank group, Ulysses alone on 2-rank groups); the hybrid
# (gated DeltaNet beside attention) with each linear_strategy
CASES = [("llama", dict(strategy="zigzag"), 0), ("llama", dict(strategy="ulysses"), 3),
         ("llama", dict(strategy="zigzag", ulysses_size=2), 2),
         ("qwen3_5_text", dict(strategy="ring", linear_strategy="ulysses"), 0),
         ("qwen3_5_text", dict(strategy="zigzag", lasp_comm="ring"), 3)]


def _build(name, dtype=torch.float32, state=None):
    if name == "llama":
        return tiny_model("llama", dtype, state)
    return build(hybrid_config(name), dtype, state)


def _documents(vocab):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g) for n in LENGTHS]


def _reference(name, state, dtype):
    """(loss, {name: grad}) of the plain model, each document alone, over the batch's target tokens."""
    model = _build(name, dtype, state)
    total = sum(n - 1 for n in LENGTHS)
    loss = 0.0
    for ids in _documents(model.config.vocab_size):
        logits = model(input_ids=ids[None], position_ids=torch.arange(ids.numel())[None]).logits
        loss = loss + F.cross_entropy(logits[0, :-1], ids[1:], reduction="sum")
    loss = loss / total
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(dsp, engine, documents):
    """The own loop of docs/dynamic.md with the model's own loss; the gradients before the optimizer."""
    from deepspeed.utils import safe_get_full_grad
    schedule = dsp.schedule([int(d.numel()) for d in documents])
    mine = schedule.for_rank(dsp.global_rank)
    share = 0.0
    for k, mb in enumerate(mine):
        engine.set_gradient_accumulation_boundary(k == len(mine) - 1)
        with dsp.running(mb):
            out = engine(**dsp.batch(mb, [documents[i] for i in mb.documents]))
            engine.backward(out.loss, scale_wrt_gas=False)
        share += out.loss.item()
    grads = {n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()}
    return dsp.step_loss(share), grads, schedule.group_sizes, len(mine)


def _runner(runners, keys):
    """A DynamicSequenceParallel per section (every group size, built once on every rank)."""
    from ds_seqpar.dynamic import DynamicSequenceParallel
    key = tuple(sorted(keys.items()))
    if key not in runners:
        runners[key] = DynamicSequenceParallel(dict(keys, size="dynamic", max_tokens_per_rank=T), heads=4, kv_heads=2)
    return runners[key]


def _refusal(runners):
    """linear_strategy ulysses on 6 linear heads, which the group size 4 does not divide: every rank
    refuses in the same layer whatever group it runs on (here the last round's one-rank groups, one of
    them empty), so none waits in a collective for a peer that stopped."""
    from ds_seqpar.config import ConfigError
    from ds_seqpar.hf import apply_sequence_parallel
    dsp = _runner(runners, dict(strategy="ring", linear_strategy="ulysses"))
    model = apply_sequence_parallel(build(hybrid_config("qwen3_5_text", linear_num_value_heads=6), torch.float32), dsp)
    docs = _documents(model.config.vocab_size)
    mb = dsp.schedule([int(d.numel()) for d in docs]).for_rank(dsp.global_rank)[-1]
    batch = dsp.batch(mb, [docs[i] for i in mb.documents])
    said = []
    for inside in (False, True):               # outside a running block: no group to run on
        try:
            with dsp.running(mb) if inside else contextlib.nullcontext():
                model(**batch)
            said.append("ran")
        except ConfigError as err:
            said.append(str(err))
    return mb.group.size, said[1], said[0]


def _dynamic_hf(cases):
    """On every rank: each case's worst error / derived bound over the loss and every gradient."""
    import deepspeed
    from ds_seqpar.dynamic import DynamicSequenceParallel
    from ds_seqpar.hf import apply_sequence_parallel
    deepspeed.init_distributed(dist_backend="gloo")
    out, runners = [], {}
    for name, keys, stage in cases:
        dsp = _runner(runners, keys)
        state = _build(name).state_dict()
        ref, plain = _reference(name, state, torch.float64), _reference(name, state, torch.float32)
        model = apply_sequence_parallel(_build(name, state=state), dsp)
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
                  "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                  "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                          config=config, mpu=dsp.mpu)
        loss, grads, sizes, rounds = _step(dsp, engine, _documents(model.config.vocab_size))
        engine.destroy()
        assert set(grads) == set(ref[1]), f"{name}: gradients {sorted(set(grads) ^ set(ref[1]))} missing or extra"
        ratios = {"loss": _worst(torch.tensor(loss), ref[0], plain[0], **BOUND[name])}
        ratios.update({f"grad {n}": _worst(g, ref[1][n], plain[1][n], **BOUND[name]) for n, g in grads.items()})
        worst = max(ratios, key=ratios.get)
        out.append({"case": (name, keys, stage), "worst": worst, "ratio": ratios[worst], "sizes": sizes,
                    "rounds": rounds, "ulysses": {s: sp.dims.ulysses_size for s, sp in dsp.by_size.items()}})
    return out, _refusal(runners)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{n}-{s}-zero{z}" for n, s, z in CASES])
def test_dynamic_hf_step_equals_plain_data_parallelism(dynamic_hf, index):
    for rank, (results, _) in enumerate(dynamic_hf):
        r = results[index]
        what = f"{r['case']} rank {rank}"
        assert r["sizes"] == [1, 2, 4], f"{what}: the batch should use groups of 1, 2 and 4, used {r['sizes']}"
        assert r["rounds"] == dynamic_hf[0][0][index]["rounds"], f"{what}: ranks ran different numbers of passes"
        hybrid = r["case"][1].get("ulysses_size", 1) > 1
        assert not hybrid or r["ulysses"] == {1: 1, 2: 2, 4: 2}, f"{what}: ulysses degree per group size {r['ulysses']}"
        assert r["ratio"] <= 1.0, f"{what}: {r['worst']} is {r['ratio']:.3g}x the derived bound"


@pytest.fixture(scope="module")
def dynamic_hf(pool):
    return pool.run(_dynamic_hf, CASES)


def test_linear_heads_a_group_size_cannot_split_are_refused_alike_on_every_rank(dynamic_hf):
    refusals = [r for _, r in dynamic_hf]
    assert {size for size, _, _ in refusals} == {1}, f"the last round should run one-rank groups: {refusals}"
    said = {msg for _, msg, _ in refusals}
    assert len(said) == 1, f"ranks said different things: {said}"
    msg = said.pop()
    assert "6 heads" in msg and "group size 4" in msg and "size='dynamic'" in msg and "linear_strategy 'lasp'" in msg, msg


def test_a_forward_outside_a_running_micro_batch_is_refused(dynamic_hf):
    outside = {msg for _, _, msg in (r for _, r in dynamic_hf)}
    assert len(outside) == 1 and "inside `with dsp.running(mb):`" in outside.pop(), outside
