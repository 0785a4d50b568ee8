"""model.generate of an applied hybrid (gated DeltaNet / Mamba2 SSD / short-convolution layers next to softmax
attention): the prefill runs the linear layers through their configured exchange (linear_strategy lasp or
ulysses) and leaves every rank the state after the last prompt token and the prompt's last conv inputs; the
decode steps run the layers' own recurrent step on those replicated states. Greedy tokens equal the unsharded
model's generate (its float64 and float32 runs must agree), every step's scores are within the bound the
unsharded float32 run's error against float64 sets, seeded sampling gives the unsharded run's tokens, and the
ranks of a group hold bitwise the same states and scores."""
import pytest
import torch

from ds_seqpar import SequenceParallel

from ..hf_hybrids import build, hybrid_config
from ..reference import max_err

PROMPT, NEW = 27, 6        # 27: a length no layout splits, so the prefill's end padding is cut off the states


def _config(model_type):
    cfg = hybrid_config(model_type)
    cfg.use_cache = True           # the unsharded reference decodes from its own cache, as generate does
    return cfg


def _model(model_type, state=None, dtype=torch.float32):
    return build(_config(model_type), dtype, state).eval()


def _greedy(model, prompt, **kw):
    with torch.no_grad():
        return model.generate(input_ids=prompt, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True,
                              output_scores=True, pad_token_id=0, eos_token_id=None, **kw)


def _sampled(model, prompt, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(input_ids=prompt, max_new_tokens=NEW, do_sample=True, temperature=0.8, top_k=20,
                              top_p=0.9, pad_token_id=0, eos_token_id=None)


def check_hybrid_generate(model_type, cases, batch=1, sample=False):
    """On every rank: each case's greedy generate (and seeded sampling) against the unsharded model's; returns per
    case (what, worst error / bound over the steps, the scores' and states' bytes)."""
    from ds_seqpar.hf import apply_sequence_parallel
    state = _model(model_type).state_dict()
    prompt = torch.randint(3, _config(model_type).vocab_size, (batch, PROMPT), generator=torch.Generator().manual_seed(2))
    ref64, ref32 = _greedy(_model(model_type, state, torch.float64), prompt), _greedy(_model(model_type, state), prompt)
    assert torch.equal(ref64.sequences, ref32.sequences), f"{model_type}: float32 and float64 greedy differ (test model)"
    sampled = _sampled(_model(model_type, state), prompt, seed=11) if sample else None
    checked = []
    for cfg in cases:
        sp = SequenceParallel(cfg)
        model = apply_sequence_parallel(_model(model_type, state), sp)
        what = f"{model_type} {cfg} sp_rank={sp.rank}"
        out = _greedy(model, prompt)
        assert torch.equal(out.sequences, ref64.sequences), f"{what}: {out.sequences} != {ref64.sequences}"
        ratios = []
        for i, (s, r64, r32) in enumerate(zip(out.scores, ref64.scores, ref32.scores)):
            ratios.append(_ratio(s, r64, r32))
            assert ratios[-1] <= 1.0, f"{what} scores step {i}: {ratios[-1]:.3g}x the bound"
        if sampled is not None:
            got = _sampled(model, prompt, seed=11)
            assert torch.equal(got, sampled), f"{what} sampling: {got} != {sampled}"
        checked.append((what, max(ratios), [s.numpy().tobytes() for s in out.scores]))
    return checked


def _ratio(got, ref64, plain, k=5.0, floor=1e-6):
    """Error against float64 over test_generate's bound (tests/reference.py: K x the plain float32 run's error
    plus a floor of the largest value)."""
    bound = k * max_err(plain, ref64) + floor * (ref64.abs().max().item() or 1.0)
    return max_err(got, ref64) / bound


CASES = [dict(strategy="zigzag", size=2), dict(strategy="ring", size=4, lasp_comm="ring"),
         dict(strategy="ulysses", size=2, linear_strategy="ulysses"),
         dict(strategy="zigzag", size=4, linear_strategy="ulysses")]


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "bamba"])
def test_hybrid_generate_matches_unsharded(pool, model_type):
    results = pool.run(check_hybrid_generate, model_type, CASES, 1, True)
    assert all(len(r) == len(CASES) for r in results), results
