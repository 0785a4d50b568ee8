"""The zoo sweep: every decoder-only causal LM of the installed transformers (from its own auto
mapping, not hand-picked), as a tiny random-init model built from its own config class, under every
softmax strategy at P=2: exact against the unsharded model (logits, loss, gradients summed over the
sequence group, derived float64 tolerances) or refused with the feature named. tests/dist/test_hf_zoo.py
runs it; ``python -m tests.hf_zoo`` writes docs/models.md from the same sweep.
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
            vocab_size_per_layer_input=128, hidden_size_per_layer_input=16, global_head_dim=16)
MLA = dict(q_lora_rank=16)      # MLA configs (qk_rope_head_dim): head_dim is the rope part, not set


def causal_lm_types():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type):
    """The model type's own config class with the tiny sizes it has keys for; a window and a chunk
    size shorter than the sequence where the architecture has them; a nested text config shrunk
    the same way (multimodal models: refused by name once built)."""
    from transformers import CONFIG_MAPPING
    cls = CONFIG_MAPPING[model_type]
    return cls(**_tiny_kwargs(cls()))


def _tiny_kwargs(default):
    values = default.to_dict()
    keys = set(values)
    kw = {k: v for k, v in TINY.items() if k in keys}
    layers = next((values[k] for k in ("num_hidden_layers", "num_layers", "n_layer") if isinstance(values.get(k), int)),
                  None)
    for k, v in values.items():                       # per-layer lists given as defaults: the first 2 layers
        if isinstance(v, list) and layers and len(v) == layers and k not in kw:
            kw[k] = v[:2]
    if "qk_rope_head_dim" in keys:
        kw.pop("head_dim", None)
        kw.update({k: v for k, v in MLA.items() if k in keys and getattr(default, k) is not None})
        if getattr(default, "q_lora_rank", None) is None:
            kw["q_lora_rank"] = None
    text = getattr(default, "text_config", None)
    if text is not None and hasattr(text, "to_dict") and text is not default:
        layers = getattr(text, "num_hidden_layers", None)
        base = {k: v for k, v in text.to_dict().items()           # per-layer lists: rebuilt for 2 layers
                if not (isinstance(v, list) and layers and len(v) == layers)}
        kw["text_config"] = dict(base, **_tiny_kwargs(text))
    # training-mode randomness (dropout, router jitter) would differ between the runs compared
    kw.update({k: 0.0 for k in keys if ("dropout" in k or "pdrop" in k or "jitter" in k)
               and isinstance(getattr(default, k, None), float)})
    if getattr(default, "sliding_window", None) is not None:
        kw["sliding_window"] = WINDOW
    if getattr(default, "attention_chunk_size", None) is not None:
        kw["attention_chunk_size"] = WINDOW
    if getattr(default, "vocab_size", None) is None:
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


def _check_size(cfg):
    """Count the parameters on the meta device first: a config whose sizes the generic shrink missed
    would take gigabytes per rank."""
    import transformers as T
    with torch.device("meta"):
        n = sum(p.numel() for p in T.AutoModelForCausalLM.from_config(cfg).parameters())
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
    if state is not None:
        model.load_state_dict(state)
    return model.to(dtype).train()


def _unsharded(cfg, state, ids, labels, dtype):
    from .hf_models import textbook_loss
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


def check_model(model_type, sps):
    """{strategy: outcome} for one model type; outcome ("exact", ratio) | ("refused", message) |
    ("mismatch", what) | ("error", message)."""
    from ds_seqpar.config import ConfigError
    from ds_seqpar.hf import apply_sequence_parallel
    from .dist.test_hf import _summed_grads
    try:
        cfg = tiny_config(model_type)
        _check_size(cfg)
        state = _build(cfg, torch.float32).state_dict()
        ids, labels = _batch(cfg.get_text_config(decoder=True).vocab_size)
        ref = _unsharded(cfg, state, ids, labels, torch.float64)
        plain = _unsharded(cfg, state, ids, labels, torch.float32)
    except Exception as err:                                # noqa: BLE001 - reported, not hidden
        return {s: ("unbuilt", f"{type(err).__name__}: {str(err).splitlines()[0][:160]}") for s in sps}
    out = {}
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
            out[name] = ("error", f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
            continue
        logits = sp.unshard(res.logits.detach(), dim=1, seq_len=SEQ)
        grads = _summed_grads(model, sp.group)
        ratios = {"logits": _worst(logits, ref[0], plain[0]), "loss": _worst(res.loss.detach(), ref[1], plain[1])}
        missing = set(ref[2]) ^ set(grads)
        for n, g in grads.items():
            if n in ref[2]:
                ratios[f"grad {n}"] = _worst(g, ref[2][n], plain[2][n])
        worst = max(ratios, key=ratios.get)
        if missing or ratios[worst] > 1.0:
            out[name] = ("mismatch", f"{worst}: {ratios[worst]:.2g}x the bound" if not missing
                         else f"gradients missing or extra: {sorted(missing)[:3]}")
        else:
            out[name] = ("exact", ratios[worst])
    return out


def sweep(model_types):
    """On every rank of the pool (sequence groups of 2): each data-parallel group takes every other
    model type. Returns [(model_type, {strategy: outcome}, seconds)] of this rank's group."""
    from ds_seqpar import SequenceParallel
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
        counts[key] = counts.get(key, 0) + 1
    lines = [
        "# Hugging Face models: the support matrix",
        "",
        "Generated by the zoo sweep (tests/hf_zoo.py, run in CI by tests/dist/test_hf_zoo.py): every model type",
        "in the installed transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, built as a tiny random-init model from",
        f"its own config class (hidden 64, 2 layers, 4 heads / 2 k/v heads where the config has those keys; a",
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
    out = pathlib.Path(__file__).resolve().parent.parent / "docs" / "models.md"
    out.write_text(render(rows, seconds, "python -m tests.hf_zoo"))
    print(f"wrote {out} ({len(rows)} model types, {seconds:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
