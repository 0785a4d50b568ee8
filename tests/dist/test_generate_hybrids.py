"""model.generate of an applied hybrid (gated DeltaNet / Kimi delta / Mamba2 SSD / Mamba-1 / short-convolution
layers, with or next to softmax attention): the prefill runs the linear layers through their configured exchange
(linear_strategy lasp: each lasp_comm; or ulysses) and leaves every rank the state after the last prompt token and
the prompt's last conv inputs; the decode steps run the layers' own recurrent step on those replicated states.

Checked against the unsharded model's own generate (its float64 and float32 runs must agree): greedy tokens equal;
every step's scores, and every linear layer's conv and recurrent state at the end, within the bound the unsharded
float32 run's error against float64 sets (test_generate.py's: 5x plus 1e-6 of the largest value); seeded sampling
gives the unsharded run's tokens; the ranks of a group hold bitwise the same states and scores; the prefill's
state bytes equal cost/decode.py's closed form, the linear exchange ran once per layer (the prefill) and the decode
steps merged only the attention layers. Families still refused are refused by name on every rank."""
import pytest
import torch

from ds_seqpar import SequenceParallel

from ..zoo.hybrids import HYBRIDS, build, hybrid_config
from ..reference import max_err

PROMPT, NEW = 27, 6        # 27: a length no layout splits, so the prefill's end padding is cut off the states


def _config(model_type):
    from ..zoo.decoders import tiny_config
    cfg = hybrid_config(model_type) if model_type in HYBRIDS else tiny_config(model_type)   # mamba2: the zoo's
    cfg.use_cache = True           # the unsharded reference decodes from its own cache, as generate does
    return cfg


def _model(model_type, state=None, dtype=torch.float32):
    return build(_config(model_type), dtype, state).eval()


def _greedy(model, prompt, new=NEW):
    with torch.no_grad():
        return model.generate(input_ids=prompt, max_new_tokens=new, do_sample=False, return_dict_in_generate=True,
                              output_scores=True, pad_token_id=0, eos_token_id=None)


def _sampled(model, prompt, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(input_ids=prompt, max_new_tokens=NEW, do_sample=True, temperature=0.8, top_k=20,
                              top_p=0.9, pad_token_id=0, eos_token_id=None)


def _ratio(got, ref64, plain, k=5.0, floor=1e-6):
    """Error against float64 over test_generate's bound (tests/reference.py's assert_derived_close: K x the plain
    float32 run's error plus a floor of the largest value)."""
    bound = k * max_err(plain, ref64) + floor * (ref64.abs().max().item() or 1.0)
    return max_err(got, ref64) / bound


def _states(cache):
    """{(layer, conv | recurrent): tensor} of a cache's linear layers."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin
    return {(i, kind): t for i, layer in enumerate(cache.layers) if isinstance(layer, LinearAttentionCacheLayerMixin)
            for kind, states in (("conv", layer.conv_states), ("recurrent", layer.recurrent_states))
            for t in states.values() if t is not None}


def check_hybrid_generate(model_type, cases, batch=1, sample=False):
    """On every rank: each case's greedy generate (and seeded sampling) against the unsharded model's; returns per
    case (what, the worst error / bound, the scores' and states' bytes)."""
    from ds_seqpar.hf import apply_sequence_parallel
    from ds_seqpar.hf.kv_cache import ReplicatedStateLayer, ShardedKVCache
    state = _model(model_type).state_dict()
    vocab = _config(model_type).vocab_size
    prompt = torch.randint(3, vocab, (batch, PROMPT), generator=torch.Generator().manual_seed(2))
    ref64, ref32 = _greedy(_model(model_type, state, torch.float64), prompt), _greedy(_model(model_type, state), prompt)
    assert torch.equal(ref64.sequences, ref32.sequences), f"{model_type}: float32 and float64 greedy differ"
    states64, states32 = _states(ref64.past_key_values), _states(ref32.past_key_values)
    # the states the prompt leaves (one new token: no decode step), before a fast decay could hide an error
    prefill64, prefill32 = (_states(_greedy(_model(model_type, state, dtype), prompt, 1).past_key_values)
                            for dtype in (torch.float64, torch.float32))
    sampled = _sampled(_model(model_type, state), prompt, seed=11) if sample else None
    checked = []
    for cfg in cases:
        sp = SequenceParallel(cfg)
        model = apply_sequence_parallel(_model(model_type, state), sp)
        what = f"{model_type} {cfg} sp_rank={sp.rank}"
        sp.stats.reset()
        out = _greedy(model, prompt)
        assert torch.equal(out.sequences, ref64.sequences), f"{what}: {out.sequences} != {ref64.sequences}"
        ratios = [_ratio(s, r64, r32) for s, r64, r32 in zip(out.scores, ref64.scores, ref32.scores)]
        assert len(ratios) == NEW and max(ratios) <= 1.0, f"{what} scores: {max(ratios):.3g}x the bound ({ratios})"
        cache = out.past_key_values
        assert isinstance(cache, ShardedKVCache), type(cache)
        states = _states(cache)
        _check_traffic(what, sp, cfg, model, cache, states)
        prefilled = _states(_greedy(model, prompt, 1).past_key_values)
        for when, got, r64, r32 in (("after the prefill", prefilled, prefill64, prefill32),
                                    ("after generate", states, states64, states32)):
            assert got.keys() == r64.keys() and got, (what, sorted(got), sorted(r64))
            for key, t in got.items():
                assert isinstance(cache.layers[key[0]], ReplicatedStateLayer), (what, key)
                assert t.shape == r64[key].shape, (what, key, t.shape, r64[key].shape)
                ratios.append(_ratio(t, r64[key], r32[key]))
                assert ratios[-1] <= 1.0, f"{what} {key} state {when}: {ratios[-1]:.3g}x the bound"
        if sampled is not None:
            got = _sampled(model, prompt, seed=11)
            assert torch.equal(got, sampled), f"{what} sampling: {got} != {sampled}"
        checked.append((what, max(ratios), [s.numpy().tobytes() for s in out.scores]
                        + [states[k].numpy().tobytes() for k in sorted(states)]))
    return checked


def _check_traffic(what, sp, cfg, model, cache, states):
    """The prefill's state bytes equal cost/decode.py's form; the linear exchange ran once per layer (in the
    prefill: the decode steps ran the layers' own step), the decode merges only in the attention layers."""
    from ds_seqpar.cost.decode import prefill_state_bytes
    from ds_seqpar.hf.kv_cache import ShardedLayer
    heads_parallel = cfg.get("linear_strategy") == "ulysses"
    want = [0, 0]
    for (_, kind), t in states.items():
        nbytes = t.numel() * t.element_size()
        got = prefill_state_bytes(sp.size, nbytes if kind == "recurrent" else 0, nbytes if kind == "conv" else 0,
                                  heads_parallel)
        want = [want[0] + got[0], want[1] + got[1]]
    assert [sp.stats.bytes["prefill_state"], sp.stats.bytes["prefill_conv_state"]] == want, (what, sp.stats.as_dict())
    convs = sum(kind == "conv" for _, kind in states)
    assert sp.stats.calls["prefill_conv_state"] == convs and sp.stats.calls["conv_halo"] == convs, sp.stats.as_dict()
    exchange = "linear_all_to_all" if heads_parallel else "lasp_state"
    recurrent = sum(kind == "recurrent" for _, kind in states)
    assert (sp.stats.calls[exchange] > 0) == (recurrent > 0), (what, sp.stats.as_dict())
    attention = sum(isinstance(layer, ShardedLayer) and layer.is_initialized for layer in cache.layers)   # not MoE slots
    assert sp.stats.calls["decode_merge"] == (NEW - 1) * attention, (what, sp.stats.as_dict())


def _run(pool, model_type, cases, sample=False):
    results = pool.run(check_hybrid_generate, model_type, cases, 1, sample)
    for i, cfg in enumerate(cases):      # the ranks of a group: bitwise the same scores and states
        assert all(r[i][2] == results[0][i][2] for r in results[:cfg["size"]]), f"{model_type} {cfg}: ranks differ"
    return results


P2, P4 = dict(size=2), dict(size=4)
# Qwen3.5 (gated DeltaNet) and Bamba (Mamba2 SSD): every state exchange and linear_strategy ulysses, P = 2 and 4
CASES = [dict(P2, strategy="zigzag"), dict(P4, strategy="ring", lasp_comm="ring"),
         dict(P4, strategy="zigzag", lasp_comm="allscan"), dict(P2, strategy="ulysses", linear_strategy="ulysses"),
         dict(P4, strategy="zigzag", linear_strategy="ulysses")]


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "bamba"])
def test_hybrid_generate_matches_unsharded(pool, model_type):
    _run(pool, model_type, CASES, sample=True)


# every other family generate decodes (families.DECODES): one lasp and one ulysses setting each, varied
FAMILIES = {
    "qwen3_next": [dict(P4, strategy="zigzag"), dict(P2, strategy="ring", linear_strategy="ulysses")],
    "qwen3_5_moe_text": [dict(P2, strategy="ring", lasp_comm="ring"), dict(P4, strategy="ulysses", linear_strategy="ulysses")],
    "olmo_hybrid": [dict(P2, strategy="zigzag"), dict(P4, strategy="ring", linear_strategy="ulysses")],
    "kimi_linear": [dict(P4, strategy="ring"), dict(P2, strategy="zigzag", linear_strategy="ulysses")],
    "bailing_hybrid": [dict(P2, strategy="ulysses", lasp_comm="ring"), dict(P4, strategy="zigzag", linear_strategy="ulysses")],
    "granitemoehybrid": [dict(P4, strategy="zigzag"), dict(P2, strategy="ring", linear_strategy="ulysses")],
    "nemotron_h": [dict(P2, strategy="ring"), dict(P4, strategy="ulysses", linear_strategy="ulysses")],
    "falcon_h1": [dict(P4, strategy="zigzag", lasp_comm="ring"), dict(P2, strategy="ulysses", linear_strategy="ulysses")],
    "mamba2": [dict(P2, strategy="zigzag"), dict(P4, strategy="ring", linear_strategy="ulysses")],
    "lfm2": [dict(P4, strategy="ring"), dict(P2, strategy="zigzag", linear_strategy="ulysses")],
    "lfm2_moe": [dict(P2, strategy="zigzag")],
    "lfm3": [dict(P4, strategy="ulysses")],
    "mamba": [dict(P2, strategy="ring"), dict(P4, strategy="zigzag", linear_strategy="ulysses")],
    "falcon_mamba": [dict(P4, strategy="zigzag", lasp_comm="ring"), dict(P2, strategy="ring", linear_strategy="ulysses")],
    "jamba": [dict(P2, strategy="zigzag"), dict(P4, strategy="ring", linear_strategy="ulysses")],
}


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_hybrid_families_generate(pool, model_type):
    _run(pool, model_type, FAMILIES[model_type])


def _said(fn):
    from ds_seqpar.hf import UnsupportedModelError
    try:
        fn()
    except UnsupportedModelError as err:
        return str(err)
    return "no error"


def hybrid_refusals():
    """Each scenario on every rank; returns {scenario: message}."""
    from ds_seqpar.hf import apply_sequence_parallel
    sp = SequenceParallel({"strategy": "zigzag", "size": 2})
    prompt = torch.randint(3, 100, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(prompt)
    mask[1, :4] = 0
    out = {}
    for name, model_type, kw in (("left padding", "qwen3_5_text", dict(attention_mask=mask)),
                                 ("lightning", "minimax", {}), ("zamba2", "zamba2", {}), ("zamba", "zamba", {}),
                                 ("equal lengths", "qwen3_5_text", dict(attention_mask=torch.ones_like(mask)))):
        model = apply_sequence_parallel(_model(model_type), sp)
        out[name] = _said(lambda: model.generate(input_ids=prompt, max_new_tokens=2, pad_token_id=0, **kw))
    return out


REFUSED = {"left padding": "with a left-padded attention_mask and linear-attention / SSM layers",
           "lightning": "with lightning attention layers (model.layers.0.self_attn; decoding them",
           "zamba2": "with Mamba2 SSD scan layers", "zamba": "with Mamba-1 selective scan layers",
           "equal lengths": "no error"}


def test_hybrid_generate_refusals_name_the_family_on_every_rank(pool):
    results = pool.run(hybrid_refusals)
    for scenario, expected in REFUSED.items():
        messages = {r[scenario] for r in results}
        assert len(messages) == 1, (scenario, messages)
        assert expected in messages.pop(), (scenario, results[0][scenario])
