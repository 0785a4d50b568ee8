"""model.generate of an applied model (a sequence-sharded KV cache): greedy tokens equal the unsharded
model's (float64 and float32 runs, which must agree, are the reference), every step's scores within
the bound the float32 run's own error against float64 sets, seeded sampling gives the unsharded run's
tokens, every rank returns the same output, and each rank's cache holds only its share of the tokens
(shares within one token of balanced; a sliding-window layer never more than its window).
Every softmax strategy and the 2D hybrid, P = 2 and 4, GQA with fewer K/V heads than ranks; a left-padded
batch of prompts of different lengths (as TRL pads rollouts), with and without sliding windows."""
from types import SimpleNamespace

import pytest
import torch

from ds_seqpar import SequenceParallel

from ..reference import assert_derived_close

PROMPT, NEW = 27, 6                  # 27: not a multiple of any layout's block, so the prompt is padded
CASES = ([{"strategy": s, "size": p} for p in (2, 4) for s in ("ulysses", "ring", "zigzag", "striped")]
         + [{"strategy": "ring", "size": 4, "ulysses_size": 2}])
WINDOW = 8


def _config(family):
    if family in ("llama", "deepseek_v3"):   # llama: 4 q heads, 2 k/v heads (fewer than the 4 ranks); MLA: v head 8
        from ..hf_models import tiny_config  # != q/k head 24
        return tiny_config(family, pad_token_id=0)
    from ..zoo.decoders import tiny_config   # sliding windows of 8 (mistral), softcap (gemma2), sinks (gpt_oss)
    config = tiny_config(family)
    if family == "gemma2":          # scores large enough that the softcap bends them (random init's are ~1e-3)
        config.initializer_range, config.attn_logit_softcapping = 0.5, 1.0
    return config


def _model(family, state=None, dtype=torch.float32):
    import transformers as T
    torch.manual_seed(0)
    # eager attention: the reference applies softcap and sinks; eager experts: gpt-oss in float64
    model = T.AutoModelForCausalLM.from_config(_config(family), attn_implementation="eager",
                                               **({"experts_implementation": "eager"} if family == "gpt_oss" else {}))
    if state is not None:
        model.load_state_dict(state)
    return model.to(dtype).eval()


def _greedy(model, prompt, **kw):
    with torch.no_grad():
        return model.generate(input_ids=prompt, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True,
                              output_scores=True, pad_token_id=0, **kw)


def _sampled(model, prompt, seed, **kw):
    torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(input_ids=prompt, max_new_tokens=NEW, do_sample=True, temperature=0.8, top_k=20,
                              top_p=0.9, pad_token_id=0, **kw)


def check_generate(family, cases, batch=1):
    """On every rank: each case's greedy (with a stop token for llama) and seeded sampled generate against the
    unsharded model's; returns the cases checked with each rank's local cache sizes."""
    from ds_seqpar.hf import apply_sequence_parallel
    from ds_seqpar.hf.kv_cache import ShardedKVCache
    state = _model(family).state_dict()
    vocab = _config(family).vocab_size
    prompt = torch.randint(3, vocab, (batch, PROMPT), generator=torch.Generator().manual_seed(2))
    ref64, ref32 = _greedy(_model(family, state, torch.float64), prompt), _greedy(_model(family, state), prompt)
    assert torch.equal(ref64.sequences, ref32.sequences), f"{family}: float32 and float64 greedy differ (test model)"
    stop = int(ref64.sequences[0, PROMPT + 2])               # a stop token: the third generated token
    stop64 = _greedy(_model(family, state, torch.float64), prompt, eos_token_id=stop)
    sampled = _sampled(_model(family, state), prompt, seed=11)
    several = _sampled(_model(family, state), prompt, seed=12, num_return_sequences=2) if batch > 1 else None
    checked = []
    for cfg in cases:
        sp = SequenceParallel(cfg)
        model = apply_sequence_parallel(_model(family, state), sp)
        what = f"{family} {cfg} sp_rank={sp.rank}"
        sp.stats.reset()
        out = _greedy(model, prompt)
        _check_bytes(what, sp, model.config, batch)
        assert torch.equal(out.sequences, ref64.sequences), f"{what}: {out.sequences} != {ref64.sequences}"
        assert len(out.scores) == NEW
        for i, (s, r64, r32) in enumerate(zip(out.scores, ref64.scores, ref32.scores)):
            assert_derived_close(f"{what} scores step {i}", s, r64, r32)
        cache = out.past_key_values
        assert isinstance(cache, ShardedKVCache), type(cache)
        sizes = _check_cache(what, cache, sp, PROMPT + NEW - 1, getattr(model.config, "sliding_window", None))
        stopped = _greedy(model, prompt, eos_token_id=stop)
        assert torch.equal(stopped.sequences, stop64.sequences), f"{what} eos: {stopped.sequences} != {stop64.sequences}"
        got = _sampled(model, prompt, seed=11)
        assert torch.equal(got, sampled), f"{what} sampling: {got} != {sampled}"
        if several is not None:          # the prompts repeated before the prefill: a batch of equal lengths
            got = _sampled(model, prompt, seed=12, num_return_sequences=2)
            assert torch.equal(got, several), f"{what} num_return_sequences=2: {got} != {several}"
        checked.append((what, sizes, [s.numpy().tobytes() for s in out.scores]))
    return checked


def _check_bytes(what, sp, config, batch):
    """The decode merges' and the prefill logits' bytes on this rank equal cost/decode.py's closed forms: one
    all-gather per layer and decode step, one all-reduce of the last prompt token's logits."""
    from ds_seqpar.cost import decode_step_bytes, prefill_logits_bytes
    heads = config.num_attention_heads
    dv = getattr(config, "v_head_dim", None) or getattr(config, "head_dim", None) or config.hidden_size // heads
    steps = NEW - 1                      # the first new token comes from the prefill's logits
    assert sp.stats.calls["decode_merge"] == steps * config.num_hidden_layers, (what, sp.stats)
    assert sp.stats.bytes["decode_merge"] == steps * decode_step_bytes(sp.size, config.num_hidden_layers, batch,
                                                                       heads, dv), (what, sp.stats)
    assert sp.stats.bytes["prefill_logits"] == prefill_logits_bytes(sp.size, batch, config.vocab_size), what


def _check_cache(what, cache, sp, tokens, window, padded=False):
    """Shares sum to the tokens whose K/V were computed and stay balanced; each layer holds this rank's share
    (a window layer: only keys the next query can see; left-padded rows: some row's next query)."""
    assert sum(cache.shares) == tokens == cache.seen, f"{what}: shares {cache.shares}, {tokens} tokens"
    assert max(cache.shares) - min(cache.shares) <= max(1, sp.padded_len(PROMPT) // sp.size), cache.shares
    sizes = []
    for i, layer in enumerate(cache.layers):
        m = layer.keys.shape[2]            # MLA (deepseek_v3): the latents, one "head"
        assert layer.positions.numel() == m
        if layer.is_sliding and padded:        # each slot is a real token some row's next query still sees
            nxt = cache.row_positions_of(torch.tensor([tokens]))
            seen = (layer.row_positions >= 0) & (layer.row_positions > nxt - window)
            assert bool(seen.any(0).all()) and bool((seen.sum(1) <= window).all()), f"{what} layer {i}: {m} keys"
        elif layer.is_sliding:
            assert m <= window and bool((layer.positions > tokens - window).all()), f"{what} layer {i}: {m} keys"
        else:
            assert m == cache.shares[sp.rank], f"{what} layer {i}: {m} keys, share {cache.shares[sp.rank]}"
        sizes.append(m)
    return sizes


def test_generate_matches_unsharded_every_strategy(pool):
    results = pool.run(check_generate, "llama", CASES)
    assert all(len(r) == len(CASES) for r in results), results
    # no rank holds the whole cache: per case, the ranks' full-attention keys partition the tokens; and the
    # ranks of a group saw bitwise the same scores (the merge folds in the same order everywhere)
    for i in range(len(CASES)):
        size = CASES[i]["size"]
        group = [r[i][1][0] for r in results[:size]]
        assert sum(group) == PROMPT + NEW - 1 and max(group) < PROMPT + NEW - 1, group
        assert all(r[i][2] == results[0][i][2] for r in results[:size]), f"{CASES[i]}: scores differ across ranks"


def test_generate_batch_of_equal_lengths(pool):
    cases = [{"strategy": "zigzag", "size": 4}, {"strategy": "ulysses", "size": 2},
             {"strategy": "striped", "size": 4, "ulysses_size": 2}]
    results = pool.run(check_generate, "llama", cases, 2)
    assert all(len(r) == len(cases) for r in results), results


LENGTHS = (PROMPT, 19, 11)             # a left-padded batch: prompts of 27, 19 and 11 tokens
EVERY_ROW_PADDED = (23, 19, 11)        # no row fills the batch's 27 tokens: 4 columns of pads in every row


def _left_padded(vocab, lengths):
    """input_ids [rows, PROMPT] of prompts of ``lengths``, padded on the left with 0 (pad_token_id), and its mask."""
    ids = torch.zeros(len(lengths), PROMPT, dtype=torch.long)
    mask = torch.zeros_like(ids)
    gen = torch.Generator().manual_seed(5)
    for b, n in enumerate(lengths):
        ids[b, PROMPT - n:] = torch.randint(3, vocab, (n,), generator=gen)
        mask[b, PROMPT - n:] = 1
    return ids, mask


def check_left_padded(family, cases, lengths=LENGTHS):
    """On every rank: generate on a left-padded batch (as TRL pads rollouts) against the unsharded model's generate
    on the same batch: greedy tokens equal, every step's scores within the derived bound, seeded sampling equal.
    The float64 reference is each prompt generated alone (transformers' own float64 eager run of the padded batch
    gives NaN scores for the padded rows); the unsharded float32 run
    of the padded batch must give its tokens, and its error against it sets the bound. No stop token
    (eos_token_id=None): every row runs all NEW steps, alone as in the batch."""
    from ds_seqpar.hf import apply_sequence_parallel
    state = _model(family).state_dict()
    ids, mask = _left_padded(_config(family).vocab_size, lengths)
    ref32 = _greedy(_model(family, state), ids, attention_mask=mask, eos_token_id=None)
    alone = [_greedy(_model(family, state, torch.float64), ids[b:b + 1, PROMPT - n:], eos_token_id=None)
             for b, n in enumerate(lengths)]
    new = torch.cat([a.sequences[:, n:] for a, n in zip(alone, lengths)])
    ref64 = SimpleNamespace(sequences=torch.cat([ids, new], 1),
                            scores=[torch.cat([a.scores[i] for a in alone]) for i in range(NEW)])
    assert torch.equal(ref64.sequences, ref32.sequences), f"{family}: padded float32 and alone float64 differ"
    sampled = _sampled(_model(family, state), ids, seed=13, attention_mask=mask, eos_token_id=None)
    several = _sampled(_model(family, state), ids, seed=14, attention_mask=mask, eos_token_id=None,
                       num_return_sequences=2)
    checked = []
    for cfg in cases:
        sp = SequenceParallel(cfg)
        model = apply_sequence_parallel(_model(family, state), sp)
        what = f"{family} left-padded {cfg} sp_rank={sp.rank}"
        sp.stats.reset()
        out = _greedy(model, ids, attention_mask=mask, eos_token_id=None)
        _check_bytes(what, sp, model.config, len(lengths))
        assert torch.equal(out.sequences, ref64.sequences), f"{what}: {out.sequences} != {ref64.sequences}"
        assert len(out.scores) == NEW
        for i, (s, r64, r32) in enumerate(zip(out.scores, ref64.scores, ref32.scores)):
            assert_derived_close(f"{what} scores step {i}", s, r64, r32)
        cache = out.past_key_values
        _check_cache(what, cache, sp, PROMPT + NEW - 1, getattr(model.config, "sliding_window", None), padded=True)
        for layer in cache.layers:       # each row's pads are masked slots; its decode tokens count on from its length
            real = (layer.row_positions >= 0).sum(1)
            assert layer.row_positions.shape == (len(lengths), layer.positions.numel()), what
            if not layer.is_sliding:
                mine = layer.positions[None] < torch.tensor(lengths)[:, None]
                assert torch.equal(real, (mine | (layer.positions >= PROMPT)[None]).sum(1)), what
        got = _sampled(model, ids, seed=13, attention_mask=mask, eos_token_id=None)
        assert torch.equal(got, sampled), f"{what} sampling: {got} != {sampled}"
        if not checked:                  # the padded rows and their masks repeated before the prefill
            got = _sampled(model, ids, seed=14, attention_mask=mask, eos_token_id=None, num_return_sequences=2)
            assert torch.equal(got, several), f"{what} num_return_sequences=2: {got} != {several}"
        checked.append((what, [s.numpy().tobytes() for s in out.scores]))
    return checked


def test_generate_left_padded_batch(pool):
    cases = [{"strategy": s, "size": p} for p in (2, 4) for s in ("zigzag", "ulysses")] \
        + [{"strategy": "ring", "size": 4, "ulysses_size": 2}]
    results = pool.run(check_left_padded, "llama", cases)
    assert all(len(r) == len(cases) for r in results), results
    for i, cfg in enumerate(cases):      # the ranks of a group saw bitwise the same scores
        assert all(r[i][1] == results[0][i][1] for r in results[:cfg["size"]]), f"{cfg}: scores differ across ranks"


@pytest.mark.parametrize("family", ["mistral", "gpt_oss", "deepseek_v3", "gemma2"])
def test_generate_left_padded_families(pool, family):
    """Sliding windows (mistral: every layer; gpt-oss: alternating, with sinks) over the rows' own positions, MLA
    (deepseek_v3: the cache holds latents), softcap (gemma2); every row padded (the rotated batch ends in pads
    in every row)."""
    results = pool.run(check_left_padded, family, [{"strategy": "zigzag", "size": 4}], EVERY_ROW_PADDED)
    assert all(len(r) == 1 for r in results), results


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gpt_oss", "deepseek_v3"])
def test_generate_windows_softcap_sinks(pool, family):
    cases = [{"strategy": "zigzag", "size": 2}, {"strategy": "striped", "size": 4},
             {"strategy": "ring", "size": 4, "ulysses_size": 2}]
    results = pool.run(check_generate, family, cases)
    assert all(len(r) == len(cases) for r in results), results


def _message(fn):
    from ds_seqpar.hf import UnsupportedModelError
    try:
        fn()
    except UnsupportedModelError as err:
        return str(err)
    return "no error"


def generate_refusals():
    """Every scenario on every rank (each refused before any collective but the agreement all-reduce, so none
    hangs); returns {scenario: message}."""
    from transformers import DynamicCache

    from ds_seqpar import comm
    from ds_seqpar.hf import apply_sequence_parallel
    from ..zoo.hybrids import build, hybrid_config
    sp = SequenceParallel({"strategy": "zigzag", "size": 4})
    model = apply_sequence_parallel(_model("llama"), sp)
    prompt = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(0))

    def gen(ids=prompt, **kw):
        return lambda: model.generate(input_ids=ids, max_new_tokens=2, pad_token_id=0, **kw)
    out = {"beams": _message(gen(num_beams=2)),
           "assistant": _message(gen(assistant_model=_model("llama"))),
           "prompt lookup": _message(gen(prompt_lookup_num_tokens=2)),
           "cache": _message(gen(past_key_values=DynamicCache(config=model.config))),
           "no cache": _message(gen(use_cache=False)),
           "hidden states": _message(gen(output_hidden_states=True, return_dict_in_generate=True))}
    other = prompt.clone()
    if comm.global_rank() == 1:
        other[0, 5] += 1
    out["prompt differs"] = _message(gen(other))
    torch.manual_seed(comm.global_rank())
    out["seed differs"] = _message(gen(do_sample=True))
    torch.manual_seed(3)
    out["same seed"] = _message(gen(do_sample=True))
    padded = torch.cat([prompt, prompt])
    mask = torch.ones_like(padded)
    mask[1, :3] = 0
    out["left padding"] = _message(gen(padded, attention_mask=mask))
    inner = torch.ones_like(padded)
    inner[1, 4:6] = 0
    out["inner zeros"] = _message(gen(padded, attention_mask=inner))
    out["right padding"] = _message(gen(padded, attention_mask=mask.flip(1)))
    out["equal lengths"] = _message(gen(padded, attention_mask=torch.ones_like(mask)))
    hybrid = hybrid_config("qwen3_5_text")
    linear = apply_sequence_parallel(build(hybrid, torch.float32), sp)
    checkpointed = apply_sequence_parallel(_model("llama"), sp)
    checkpointed.gradient_checkpointing_enable()
    checkpointed.train()
    out["checkpointing"] = _message(lambda: checkpointed.generate(input_ids=prompt, max_new_tokens=2, pad_token_id=0))
    checkpointed.eval()
    out["checkpointing, eval"] = _message(lambda: checkpointed.generate(input_ids=prompt, max_new_tokens=2,
                                                                        pad_token_id=0))
    # hybrids decode (tests/dist/test_generate_hybrids.py), but not from a left-padded batch
    out["linear layers"] = _message(lambda: linear.generate(input_ids=padded, attention_mask=mask, max_new_tokens=2,
                                                            pad_token_id=0))
    # ranks that pick different tokens (here a logits processor of rank 1's own): the next step's first merge
    # carries the tokens, and every rank stops there with the same error
    from transformers import LogitsProcessorList
    bias = 1e4 * (comm.global_rank() % 2)

    def skewed(input_ids, scores):
        scores[:, 5] += bias
        return scores
    try:
        model.generate(input_ids=prompt, max_new_tokens=3, pad_token_id=0, do_sample=False,
                       logits_processor=LogitsProcessorList([skewed]))
        out["ranks diverge"] = "no error"
    except RuntimeError as err:
        out["ranks diverge"] = str(err)
    return out


REFUSED = {
    "beams": "generate with num_beams=2 under sequence parallelism (a sequence-sharded KV cache) is not supported; "
             "use num_beams=1",
    "assistant": "with assistant_model=LlamaForCausalLM", "prompt lookup": "with prompt_lookup_num_tokens=2",
    "cache": "with past_key_values=DynamicCache", "no cache": "with use_cache=False",
    "hidden states": "with output_hidden_states=True",
    "prompt differs": "got a different input_ids on the ranks", "seed differs": "random state (torch.manual_seed)",
    "same seed": "no error", "left padding": "no error",
    "inner zeros": "with an attention_mask that is not left padding (zeros between or after real tokens",
    "right padding": "with an attention_mask that is not left padding (zeros between or after real tokens",
    "equal lengths": "no error",
    "linear layers": "with a left-padded attention_mask and linear-attention / SSM layers",
    "checkpointing": "with gradient checkpointing in training mode", "checkpointing, eval": "no error",
    "ranks diverge": "the ranks of a sequence group decode different tokens",
}


def test_generate_refusals_name_the_option_on_every_rank(pool):
    results = pool.run(generate_refusals)
    for scenario, expected in REFUSED.items():
        messages = {r[scenario] for r in results}
        assert len(messages) == 1, (scenario, messages)           # the same message on every rank
        assert expected in messages.pop(), (scenario, results[0][scenario])
