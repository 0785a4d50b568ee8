"""The zoo sweep: every decoder-only causal LM of the installed transformers (from its own auto
mapping, not hand-picked), as a tiny random-init model built from its own config class, under every
softmax strategy at P=2: exact against the unsharded model (logits, loss, gradients summed over the
sequence group, derived float64 tolerances) or refused with the feature named. tests/dist/test_hf_zoo.py
runs it; ``python -m tests.zoo.decoders`` writes docs/models.md from the same sweep.
"""
import time
import traceback

import torch

SEQ = 32
WINDOW = 8                      # sliding windows shorter than the sequence and than a shard at P=2
STRATEGIES = ("ulysses", "ring", "zigzag", "striped")
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=256,
            moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4,
            num_experts_per_tok=2, attention_dropout=0.0, use_cache=False, tie_word_embeddings=False,
            shared_expert_intermediate_size=32, expert_intermediate_size=32, ffn_hidden_size=96,
            kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            first_k_dense_replace=1, n_group=1, topk_group=1, num_layers=2, n_layer=2, n_head=4, n_embd=64,
            d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=96, decoder_ffn_dim=96, n_layers=2, n_heads=4, num_heads=4, rotary_dim=8,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=0,
            vocab_size_per_layer_input=128, hidden_size_per_layer_input=16, global_head_dim=16,
            num_experts_per_token=2, num_dense_layers=1, moe_topk=2, zero_expert_num=2, num_expert_group=1,
            # Mamba2 mixers (heads x head dim = expand x hidden); an 8-token chunk: two per rank at P=2
            mamba_n_heads=4, mamba_d_head=32, mamba_d_ssm=128, mamba_n_groups=2, mamba_d_state=16,
            mamba_chunk_size=8, mamba_num_heads=4, mamba_head_dim=32, ssm_state_size=16, n_groups=2,
            # DeepSeek sparse attention: a small indexer whose top-k is shorter than the sequence and a shard
            index_n_heads=4, index_head_dim=16, index_topk=8,
            # Llama 4's attention temperature grows every floor_scale positions (default 8192): within the sequence
            floor_scale=4)
TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_topk")    # never above the default (some allow only 1)
MLA = dict(q_lora_rank=16)      # MLA configs (qk_rope_head_dim): head_dim is the rope part, not set
FILL = dict(n_shared_experts=1)  # sizes a default leaves None that the model multiplies with
# size keys beyond TINY's (any config level, ints > 64 only): the first pattern that matches the name wins
SIZES = ((r"token|position|window|max_|seed|rate|chunk|length|image_size|crop|patch|topk|bucket|distance"
          r"|divisible|offset|scalar|multiple|groups|num_", None),
         (r"head_dim$|^dim_head$|kv_channels", 16), (r"(^|_)(low)?rank$", 16),
         (r"intermediate|ffn|(^|_)d_?ff$|^dff$|dim_ff|mlp_dim|d_inner|feed_forward", 96), (r"vocab", 128),
         (r"hidden|embed_dim|emb_dim|embedding_size|channels?$|d_model|_dim$|input_size", 64))
# per model type, only what no rule on the config's attributes can express
QWEN4_QSA = dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16,
                 indexer_compress_ratio=4)
OVERRIDES = {
    # DbrxAttention reads attn_config.rope_theta, a key DbrxAttentionConfig does not define (no default), and
    # clamps q/k/v with clip_qkv unconditionally, so its default None crashes (DBRX itself uses 8)
    "dbrx": dict(attn_config=dict(rope_theta=10000.0, clip_qkv=8.0)),
    # the default layer_types is None, which the modeling indexes; LFM2-MoE mixes conv and attention layers
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    # the default layer_types name QSA (indexed) layers but every QSA size defaults to None, which the modeling
    # divides: a small indexer (one k/v head, as the config requires; a budget shorter than the sequence)
    "qwen4_exp": dict(text_config=dict(QWEN4_QSA)), "qwen4_exp_text": QWEN4_QSA,
    # the causal LM head asserts is_decoder, which the config leaves False by default
    "reformer": dict(is_decoder=True),
}


# rows beside a type's own: its tiny config with one feature the default refuses turned off, so that the
# rest of the architecture still gets an exact-or-refused verdict (the type's own row keeps the refusal)
VARIANTS = {"llama4_text, attn_temperature_tuning=False": ("llama4_text", dict(attn_temperature_tuning=False))}


def causal_lm_types():
    """Every causal LM type of the installed transformers, then the VARIANTS rows."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) + [v for v in VARIANTS if VARIANTS[v][0] in
                                                         MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]


def tiny_config(model_type):
    """The model type's own config class with the tiny sizes it has keys for; a window and a chunk
    size shorter than the sequence where the architecture has them; nested configs (text, vision,
    audio, attention / ffn parts) shrunk the same way (multimodal models: refused by name once built)."""
    from transformers import CONFIG_MAPPING
    model_type, extra = VARIANTS.get(model_type, (model_type, {}))
    cls = CONFIG_MAPPING[model_type]
    for sizes in (False, True):      # the size keys TINY does not name: only where the model stays too big
        kw = _tiny_kwargs(cls(), sizes=sizes)   # or is inconsistent without them
        for k, v in dict(OVERRIDES.get(model_type, {}), **extra).items():
            kw[k] = dict(kw.get(k) or {}, **v) if isinstance(v, dict) else v
        try:
            cfg = cls(**kw)
            if sizes or _param_count(cfg) <= MAX_PARAMS:
                return cfg
        except Exception:                            # noqa: BLE001 - the second pass raises it
            if sizes:
                raise


def _layer_count_key(values):
    return next((k for k in ("num_hidden_layers", "num_layers", "n_layer", "n_layers") if isinstance(values.get(k), int)
                 and not isinstance(values.get(k), bool)), None)


def _kept_layers(values, layers, start=None):
    """The layers the tiny model keeps: the first of every kind a per-layer list of names gives (layer_types,
    mlp_layer_types, ...) and the first layer a per-layer override names, then the first layers up to 2; where
    the last layers reuse earlier layers' k/v (num_kv_shared_layers), the same again among those."""
    shared = values.get("num_kv_shared_layers") or 0
    if shared and start is None:
        return _kept_layers(values, layers - shared, 0) + _kept_layers(values, layers, layers - shared)
    start = start or 0
    keep = set()
    for v in values.values():
        if isinstance(v, list) and len(v) == len(values.get("layer_types") or v) and all(isinstance(x, str) for x in v):
            keep |= {v.index(x, start) for x in set(v[start:layers])}
    per_layer = values.get("per_layer_config")
    if isinstance(per_layer, dict) and [i for i in per_layer if start <= int(i) < layers]:
        keep.add(min(int(i) for i in per_layer if start <= int(i) < layers))
    i = start
    while len(keep) < min(2, layers - start):
        keep.add(i)
        i += 1
    return sorted(keep)


def _widths(values, kw):
    return {values[k]: kw[k] for k in ("head_dim", "d_model", "n_embd", "hidden_size")
            if isinstance(values.get(k), int) and isinstance(kw.get(k), int) and values[k] > 64}


def _tiny_kwargs(default, linked=None, sizes=True):
    """``linked``: {default size: tiny size} of the enclosing configs' widths, for sizes that must equal them."""
    import re
    from transformers import PreTrainedConfig
    values = default.to_dict()
    keys = set(values)
    linked = dict(linked or {})
    kw = {k: v for k, v in TINY.items() if k in keys and values[k] != 0}     # a 0 default is a feature turned off
    kw.update({k: v for k, v in FILL.items() if k in keys and values[k] is None})
    kw.update({k: min(kw[k], values[k]) for k in TOP_K if k in kw and isinstance(values[k], int)})
    if isinstance(values.get("expand"), int) and "num_heads" in kw and "head_dim" in kw:   # SSM heads: expand x width
        kw["num_heads"] = values["expand"] * kw["hidden_size"] // kw["head_dim"]
    if "qk_rope_head_dim" in keys:                    # MLA: head_dim scales with the rope part it contains
        kw.pop("head_dim", None)
        if isinstance(values.get("head_dim"), int) and values.get("qk_rope_head_dim") and "qk_rope_head_dim" in kw:
            kw["head_dim"] = values["head_dim"] * kw["qk_rope_head_dim"] // values["qk_rope_head_dim"]
            if values["head_dim"] == values["qk_rope_head_dim"] + (values.get("qk_nope_head_dim") or 0):
                kw["head_dim"] = kw["qk_rope_head_dim"] + kw.get("qk_nope_head_dim", 0)   # Mistral 4: the whole q/k head
        kw.update({k: v for k, v in MLA.items() if k in keys and values[k] is not None})
        if values.get("q_lora_rank") is None:
            kw["q_lora_rank"] = None
        if "qk_head_dim" in keys:                    # stored as the sum of its two parts
            kw["qk_head_dim"] = sum(kw.get(k, values[k]) for k in ("qk_nope_head_dim", "qk_rope_head_dim"))  # 0: NoPE
        if "kv_lora_rank" in keys and "num_key_value_heads" in kw:   # MLA expands k/v for every query head
            kw["num_key_value_heads"] = kw["num_attention_heads"]
    layer_key = _layer_count_key(values)
    layers = values[layer_key] if layer_key else None
    if layers:
        keep = _kept_layers(values, layers)
        kw[layer_key] = len(keep)
        if values.get("num_kv_shared_layers"):
            kw["num_kv_shared_layers"] = len([i for i in keep if i >= layers - values["num_kv_shared_layers"]])
        for k, v in values.items():                   # per-layer lists given as defaults: the kept layers
            if isinstance(v, list) and len(v) == layers:
                kw[k] = [kw[k]] * len(keep) if k in kw and not isinstance(kw[k], list) else [v[i] for i in keep]
    linked.update(_widths(values, kw))
    for k, v in values.items():                       # size keys TINY does not name: equal to a width, or by name
        if not sizes or k in kw or not isinstance(v, int) or isinstance(v, bool) or v <= 64:
            continue
        size = next((size for pattern, size in SIZES if re.search(pattern, k)), None)
        if size is not None and v in linked:
            size = linked[v]
        if size is not None:
            kw[k] = size
    per_layer = values.get("per_layer_config")
    if layers and isinstance(per_layer, dict) and per_layer:  # per-layer overrides: re-keyed, sizes scaled alike
        kw["per_layer_config"] = {
            new: {k: max(1, round(v * kw[k] / values[k])) if isinstance(v, int) and k in kw and values.get(k)
                  else v for k, v in per_layer[f"{old:02d}" if f"{old:02d}" in per_layer else old].items()}
            for new, old in enumerate(keep) if f"{old:02d}" in per_layer or old in per_layer}
    for k in sorted((k for k in keys if isinstance(values[k], dict)), key=lambda k: k != "text_config"):
        sub = getattr(default, k, None)              # nested configs (text first, then vision, audio, ...)
        if isinstance(sub, PreTrainedConfig) and sub is not default:
            sub_values = sub.to_dict()
            n = sub_values.get(_layer_count_key(sub_values) or "")
            base = {a: b for a, b in sub_values.items()           # per-layer lists: rebuilt for the kept layers
                    if not (isinstance(b, list) and n and len(b) == n)}
            kw[k] = dict(base, **_tiny_kwargs(sub, linked, sizes))
            linked.update(_widths(sub_values, kw[k]))             # e.g. an audio adapter's output = text width
    # training-mode randomness (dropout, router jitter) would differ between the runs compared
    kw.update({k: 0.0 for k in keys if ("dropout" in k or "pdrop" in k or "jitter" in k)
               and isinstance(values[k], float)})
    types = kw.get("layer_types")
    if values.get("rope_parameters") == {} and isinstance(types, list):    # rope per layer type, none given
        kw["rope_parameters"] = {t: {"rope_type": "default", "rope_theta": 10000.0} for t in set(types)}
    if values.get("sliding_window") is not None:
        kw["sliding_window"] = WINDOW
    if values.get("attention_chunk_size") is not None:
        kw["attention_chunk_size"] = WINDOW
    if values.get("vocab_size") is None:
        for k in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
            kw.pop(k, None)
    return kw


def _batch(vocab):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, SEQ), generator=g)
    labels = ids.clone()
    labels[torch.rand(1, SEQ, generator=g) < 0.2] = -100
    return ids, labels


MAX_PARAMS = 3_000_000          # a "tiny" model bigger than this kept some size key the sweep does not know


def _param_count(cfg):
    import transformers as T
    with torch.device("meta"):
        return sum(p.numel() for p in T.AutoModelForCausalLM.from_config(cfg).parameters())


def _check_size(cfg):
    """Count the parameters on the meta device first: a config whose sizes the generic shrink missed
    would take gigabytes per rank."""
    n = _param_count(cfg)
    if n > MAX_PARAMS:
        raise ValueError(f"the tiny config still has {n / 1e6:.0f}M parameters (size keys the sweep does not shrink)")


def _build(cfg, dtype, state=None):
    import transformers as T
    torch.manual_seed(0)
    # eager experts: grouped_mm has no float64 kernel, and the reference runs in float64
    try:
        model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", experts_implementation="eager")
    except (ValueError, ImportError, TypeError):
        model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    languages = getattr(cfg, "languages", None)      # per-language adapters (X-MOD): the first language's
    if languages and hasattr(model, "set_default_language"):
        model.set_default_language(languages[0])
    if state is not None:
        model.load_state_dict(state)
    return model.to(dtype).train()


def _unsharded(cfg, state, ids, labels, dtype):
    from ..hf_models import textbook_loss
    model = _build(cfg, dtype, state)
    logits = model(input_ids=ids, position_ids=torch.arange(SEQ)[None]).logits
    loss = textbook_loss(logits, labels)
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                            if p.grad is not None}


def _worst(got, ref, plain, k=5.0, floor=1e-6):
    """max over tensors of error / derived bound (<= 1 is exact)."""
    err = (got.double() - ref.double()).abs().max().item()
    bound = k * (plain.double() - ref.double()).abs().max().item() + floor * (ref.abs().max().item() or 1.0)
    return err / bound


# fp32's unit roundoff: each fp32 operation changes its result by a relative error of at most this
UNIT_ROUNDOFF = 2.0 ** -24
ROUNDING_SAMPLES = 3


class _RoundingNoise(torch.utils._python_dispatch.TorchDispatchMode):
    """Monte-Carlo arithmetic: every floating-point result of every op (forward and backward) is
    scaled by (1 + u * N(0, 1)) elementwise, u = fp32's unit roundoff, the size of the relative error
    one fp32 operation makes. Run in float64, the model then shows the spread fp32 rounding gives."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            return self._noisy(out)
        if isinstance(out, (tuple, list)):
            return type(out)(self._noisy(o) if isinstance(o, torch.Tensor) else o for o in out)
        return out

    @staticmethod
    def _noisy(t):
        if t.dtype != torch.float64 or t.numel() == 0:
            return t
        return t * (1 + UNIT_ROUNDOFF * torch.randn_like(t))


def _rounding_scale(cfg, state, ids, labels):
    """{parameter: max |gradient error|} of the float64 model whose every op result carries a random
    relative error of fp32's size (``_RoundingNoise``), over a few seeded samples: how far fp32
    rounding can move each gradient, whatever the order of the computation.

    One plain fp32 run is a single sample of that error and can be far below its typical size: a
    gradient that is a small sum of large terms of both signs (diffllama's lambda_q2 / lambda_k2:
    sum over positions of dO . softmax2 @ V, about 100 times its result) is off by 2.9e-11 in the
    plain run but by 1.3e-9 in the next layer's plain run and 0.4-5e-9 under any sharding, each
    sharding adding its own rounding order (the ring's merges). This scale follows the terms' size,
    not one run's luck; a real sharding error (a wrong mask, a lost block) is far above it."""
    from ..hf_models import textbook_loss
    worst = {}
    ref = _unsharded(cfg, state, ids, labels, torch.float64)[2]
    for seed in range(ROUNDING_SAMPLES):
        model = _build(cfg, torch.float64, state)
        torch.manual_seed(1000 + seed)
        with _RoundingNoise():
            textbook_loss(model(input_ids=ids, position_ids=torch.arange(SEQ)[None]).logits, labels).backward()
        for n, p in model.named_parameters():
            if p.grad is not None and n in ref:
                err = (p.grad - ref[n]).abs().max().item()
                worst[n] = max(worst.get(n, 0.0), err)
    return worst


def _gradient_ratio(got, ref, plain, rounding=None, k=5.0, floor=1e-6):
    """error / bound of one gradient; the bound's fp32 error scale is the plain run's error, or the
    Monte-Carlo rounding scale where that is larger (``_rounding_scale``)."""
    err = (got.double() - ref.double()).abs().max().item()
    scale = max((plain.double() - ref.double()).abs().max().item(), rounding or 0.0)
    return err / (k * scale + floor * (ref.abs().max().item() or 1.0))


def rounding_bounded_ratios(model_type, sps, names):
    """{strategy: {parameter: error / rounding-aware bound}} of the named gradients under each of
    ``sps`` (the zoo's model, batch and bounds; the Monte-Carlo scale always on)."""
    from ds_seqpar.hf import apply_sequence_parallel
    from ..dist.test_hf import _summed_grads
    cfg = tiny_config(model_type)
    state = _build(cfg, torch.float32).state_dict()
    ids, labels = _batch(cfg.get_text_config(decoder=True).vocab_size)
    ref, plain = (_unsharded(cfg, state, ids, labels, dt)[2] for dt in (torch.float64, torch.float32))
    rounding = _rounding_scale(cfg, state, ids, labels)
    out = {}
    for name, sp in sps.items():
        model = apply_sequence_parallel(_build(cfg, torch.float32, state), sp)
        model(**sp.shard_batch({"input_ids": ids, "labels": labels})).loss.backward()
        grads = _summed_grads(model, sp.group)
        out[name] = {n: _gradient_ratio(grads[n], ref[n], plain[n], rounding[n]) for n in names}
    return out


def message(err, width=200) -> str:
    """The exception's type and its first non-empty line (transformers' import errors start with a newline)."""
    lines = [line for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {(lines[0].strip() if lines else '')[:width]}"


def not_built(cfg, err, sps):
    """{strategy: outcome} of a type whose tiny model does not build or run unsharded: "refused" with
    ds_seqpar's own reason where its config check refuses the config anyway (the most permissive check:
    linear layers and towers allowed), else "unbuilt" with transformers' error."""
    from ds_seqpar.hf import UnsupportedModelError
    from ds_seqpar.hf.checks import check_config
    if cfg is not None:
        try:
            check_config(cfg, linear_ok=True, vision_ok=True)     # training=None: dropout is a setting, not the model
        except UnsupportedModelError as refusal:
            return {s: ("refused", str(refusal).splitlines()[0]) for s in sps}
        except Exception:                                   # noqa: BLE001 - transformers' error is the reason
            pass
    return {s: ("unbuilt", message(err, 160)) for s in sps}


def check_model(model_type, sps):
    """{strategy: outcome} for one model type; outcome ("exact", ratio) | ("refused", message) |
    ("mismatch", what) | ("error", message)."""
    from ds_seqpar.config import ConfigError
    from ds_seqpar.hf import apply_sequence_parallel
    from ..dist.test_hf import _summed_grads
    cfg = None
    try:
        cfg = tiny_config(model_type)
        _check_size(cfg)
        state = _build(cfg, torch.float32).state_dict()
        ids, labels = _batch(cfg.get_text_config(decoder=True).vocab_size)
        ref = _unsharded(cfg, state, ids, labels, torch.float64)
        plain = _unsharded(cfg, state, ids, labels, torch.float32)
    except Exception as err:                                # noqa: BLE001 - reported, not hidden
        return not_built(cfg, err, sps)
    out, rounding = {}, None
    for name, sp in sps.items():
        model = _build(cfg, torch.float32, state)
        try:
            apply_sequence_parallel(model, sp)
            batch = sp.shard_batch({"input_ids": ids, "labels": labels})
            res = model(**batch)
            res.loss.backward()
        except ConfigError as err:
            out[name] = ("refused", str(err).splitlines()[0])
            continue
        except Exception as err:                            # noqa: BLE001
            out[name] = ("error", message(err))
            continue
        logits = sp.unshard(res.logits.detach(), dim=1, seq_len=SEQ)
        grads = _summed_grads(model, sp.group)
        ratios = {"logits": _worst(logits, ref[0], plain[0]), "loss": _worst(res.loss.detach(), ref[1], plain[1])}
        missing = set(ref[2]) ^ set(grads)
        for n, g in grads.items():
            if n in ref[2]:
                ratios[f"grad {n}"] = _worst(g, ref[2][n], plain[2][n])
        if any(v > 1.0 for key, v in ratios.items() if key.startswith("grad ")):
            # only where one plain run's error is too lucky a bound: max(plain, rounding) >= plain, so
            # computing it lazily gives the verdict computing it always would (same seeds on both ranks)
            rounding = rounding if rounding is not None else _rounding_scale(cfg, state, ids, labels)
            for n, g in grads.items():
                if n in ref[2]:
                    ratios[f"grad {n}"] = _gradient_ratio(g, ref[2][n], plain[2][n], rounding.get(n))
        out[name] = verdict(ratios, missing)
    return out


def verdict(ratios, missing):
    """("exact", worst ratio) or ("mismatch", what): every ratio to its bound within 1, no gradient
    missing or extra."""
    worst = max(ratios, key=ratios.get)
    if missing or ratios[worst] > 1.0:
        return ("mismatch", f"{worst}: {ratios[worst]:.2g}x the bound" if not missing
                else f"gradients missing or extra: {sorted(missing)[:3]}")
    return ("exact", ratios[worst])


def sweep(model_types):
    """On every rank of the pool (sequence groups of 2): each data-parallel group takes every other
    model type. Returns [(model_type, {strategy: outcome}, seconds)] of this rank's group."""
    from ds_seqpar import SequenceParallel
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    # a ZeRO-3 config left set by an earlier Trainer run on this rank would build every model inside
    # zero.Init (partitioned, collective-heavy): fail at once rather than run slow and mismatched
    assert not is_deepspeed_zero3_enabled(), "transformers' global ZeRO-3 config is still set on this rank"
    sps = {s: SequenceParallel({"strategy": s, "size": 2}) for s in STRATEGIES}
    first = next(iter(sps.values()))
    rows = []
    for i, mt in enumerate(model_types):
        if i % first.dp_size != first.dp_rank:
            continue
        t0 = time.perf_counter()
        try:
            res = check_model(mt, sps)
        except Exception:                                   # noqa: BLE001
            res = {s: ("error", traceback.format_exc().splitlines()[-1][:200]) for s in sps}
        rows.append((mt, res, time.perf_counter() - t0))
    return rows


def merged(results):
    """The rows of both data-parallel groups (pool ranks 0 and 2 lead them), sorted by model type."""
    return sorted(results[0] + results[2], key=lambda row: row[0])


def _cell(outcome):
    kind, detail = outcome
    return {"exact": "exact", "refused": "refused", "mismatch": "**MISMATCH**", "error": "error",
            "unbuilt": "not built"}[kind]


def _reason(outcomes):
    """The refusal / error text once per row (the same for every strategy, or listed per strategy)."""
    texts = {f"{kind}: {detail}" for kind, detail in outcomes.values() if kind != "exact"}
    return "; ".join(sorted(texts)).replace("|", "\\|")


def render(rows, seconds, command):
    counts = {}
    for _, outcomes, _ in rows:
        kinds = {k for k, _ in outcomes.values()}
        key = "exact" if kinds == {"exact"} else sorted(kinds - {"exact"})[0]
        if key == "refused" and {k for s, (k, _) in outcomes.items() if s != "striped"} == {"exact"}:
            key = "exact except striped"          # hybrids: their state needs runs of tokens (docs/hybrids.md)
        counts[key] = counts.get(key, 0) + 1
    lines = [
        "# Hugging Face models: the support matrix",
        "",
        "Generated by the zoo sweep (tests/zoo/decoders.py, run in CI by tests/dist/test_hf_zoo.py): every model type",
        "in the installed transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, built as a tiny random-init model from",
        f"its own config class (hidden 64, 2 layers or the first of each kind of layer, 4 heads / 2 k/v heads where",
        "the config has those keys; nested text / vision / audio configs shrunk alike; a few per-type overrides for",
        f"defaults the modeling cannot run, see OVERRIDES; a",
        f"sliding window and a chunk size of {WINDOW} tokens where it has them), trained one step under every",
        f"softmax strategy at P=2 on {SEQ} tokens: `exact` = logits, loss and every parameter gradient (summed over",
        "the sequence group) equal the unsharded model within the float64-derived tolerance; `refused` = stopped on",
        "every rank before any collective with the feature named (the reason column); `not built` = the sweep",
        "could not build or run the tiny model unsharded (a gap of the sweep's generic config, not a verdict);",
        "`error` = failed another way (a gap to fix). A mismatch would fail the test.",
        "",
        f"Command: `{command}`; transformers {__import__('transformers').__version__}; "
        f"{len(rows)} model types in {seconds:.0f} s; " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) + ".",
        "",
        "| model type | " + " | ".join(STRATEGIES) + " | reason |",
        "|---|" + "---|" * len(STRATEGIES) + "---|",
    ]
    for mt, outcomes, _ in rows:
        lines.append(f"| `{mt}` | " + " | ".join(_cell(outcomes[s]) for s in STRATEGIES) + f" | {_reason(outcomes)} |")
    return "\n".join(lines) + "\n"


def main():
    import pathlib
    import sys
    from ds_seqpar.launch.rankpool import RankPool
    pool = RankPool(4, timeout_s=1800.0).start()
    try:
        t0 = time.perf_counter()
        rows = merged(pool.run(sweep, causal_lm_types()))
        seconds = time.perf_counter() - t0
    finally:
        pool.close()
    out = pathlib.Path(__file__).resolve().parents[2] / "docs" / "models.md"
    out.write_text(render(rows, seconds, "python -m tests.zoo.decoders"))
    print(f"wrote {out} ({len(rows)} model types, {seconds:.0f} s); slowest: "
          + ", ".join(f"{mt} {t:.1f} s" for mt, _, t in sorted(rows, key=lambda row: -row[2])[:12]), file=sys.stderr)


if __name__ == "__main__":
    main()
