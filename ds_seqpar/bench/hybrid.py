"""``ds-seqpar bench hybrid``: the linear-attention, SSM and convolution layers of Hugging Face hybrids
under sequence parallelism against the same layer unsharded, and a whole training step of a
Qwen3.5-style hybrid next to a Llama of equal size, in one run (not a test).

  layer  per family (FAMILIES) ONE transformers layer, the model's own mixer module, fwd+bwd of N
         tokens: "single" (rank 0, unapplied, all N tokens), "halves" (every rank unapplied on its N/P
         tokens: the bound no exact split beats) and the layer applied by ds_seqpar under each SP_CASES,
         in the harness's interleaved rounds; bytes per rank against the cost model's (cost/bytes.py:
         strategies/closed_form.py's forms on the shape read from the family's config).
  op     rank 0 after the rounds: the plain local op on N/P tokens against the call(s) ds_seqpar makes
         for a run's affine map (delta_rule_map, ssd_map), same captured inputs, fwd+bwd.
  train  a whole training step, P ranks vs one (train_step.measure_training), of --train-model and of a
         Llama with its sizes (equal_llama).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from typing import Dict, List, Optional

from ..report.rows import Row
from .attention_rows import step_row
from .harness import (alone, case_times, command_line, fresh_pool, measure_on_pool, rank_rounds,
                      suite_facts, suite_main, suite_parser, versus, write_page)

PROG = "ds-seqpar bench hybrid"
# the families (one linear layer of a Hugging Face hybrid each, built from the model type's own config
# class) and the sequence-parallel cases a layer runs under
SP_CASES = {"lasp_allgather": dict(linear_strategy="lasp", lasp_comm="allgather"),
            "lasp_ring": dict(linear_strategy="lasp", lasp_comm="ring"),
            "lasp_allscan": dict(linear_strategy="lasp", lasp_comm="allscan"),
            "ulysses": dict(linear_strategy="ulysses")}
# family -> (as in, model type, config keys): one linear layer of the model's own classes; head sizes as
# the named models', fewer heads (one CPU thread per rank)
FAMILIES = {
    "gdn": ("Qwen3.5 gated DeltaNet", "qwen3_5_text", dict(
        layer_types=["linear_attention"], linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4)),
    "kda": ("Kimi-Linear delta attention", "kimi_linear", dict(
        layer_types=["linear_attention"], linear_num_heads=2, linear_head_dim=32, linear_conv_kernel_dim=4)),
    "ssd": ("Bamba / Nemotron-H Mamba2 SSD", "bamba", dict(
        attn_layer_indices=[], mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=2, mamba_d_state=128,
        mamba_chunk_size=128, mamba_expand=1, mamba_d_conv=4)),
    "lightning": ("MiniMax lightning attention", "minimax", dict(
        layer_types=["linear_attention"], num_attention_heads=4, head_dim=128, block_size=256)),
    "conv": ("LFM2 gated short convolution", "lfm2", dict(layer_types=["conv"], conv_L_cache=3)),
}
_BASE = dict(num_hidden_layers=1, intermediate_size=256, num_key_value_heads=4, vocab_size=256, use_cache=False,
             tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2, num_local_experts=2,
             num_experts=2, num_experts_per_tok=1, moe_intermediate_size=64)


def family_config(name: str, hidden: int):
    """The family's model type's own config class with one linear layer at width ``hidden``."""
    from transformers import CONFIG_MAPPING
    _, model_type, keys = FAMILIES[name]
    cls = CONFIG_MAPPING[model_type]
    known = cls().to_dict()
    kw = {k: v for k, v in _BASE.items() if k in known}
    return cls(**dict(kw, hidden_size=hidden, **keys))


def family_cases(name: str, sp_cases=tuple(SP_CASES)) -> List[str]:
    """A short conv has no state: lasp ring and ulysses run the same halo as allgather. ``sp_cases``: the
    SP_CASES asked for (--sp-cases)."""
    return ["single", "halves"] + [c for c in (["lasp_allgather"] if name == "conv" else list(SP_CASES))
                                   if c in sp_cases]


def family_sizes(fam: str, hidden: int) -> str:
    """The sizes the page names: the family's config keys (not the lists that pick the layer kind)."""
    c = family_config(fam, hidden)
    return ", ".join(f"{k}={getattr(c, k)}" for k, v in FAMILIES[fam][2].items() if not isinstance(v, list))


def layer_bytes(fam: str, case: str, args) -> List[int]:
    """Bytes per rank of one fwd+bwd of the family's layer (batch 1, fp32) under ``case``: the cost model's
    (cost/bytes.linear_layer_bytes on the shape its one reader takes from the family's config), which the
    measured bytes must equal."""
    from ..cost.bytes import linear_layer_bytes
    from ..cost.candidate import Candidate, Features
    from ..cost.model_shape import from_hf_config
    shape = from_hf_config(family_config(fam, args.hidden))
    sp = SP_CASES[case]
    c = Candidate("ring", args.P, 1, 0, Features(), sp["linear_strategy"], sp.get("lasp_comm", "allgather"))
    (kind,) = set(shape.layer_kinds)
    return [sum(linear_layer_bytes(c, shape, kind, args.seq // args.P, 4, r, c.lasp_comm).values())
            for r in range(args.P)]


def _mixer(cfg, sp=None):
    """(model, its one linear layer module), seeded, applied when ``sp`` is given."""
    import torch
    from transformers import AutoModelForCausalLM
    from ..hf import apply_sequence_parallel
    from ..hf.linear.families import linear_modules
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float().train()
    if sp is not None:
        apply_sequence_parallel(model, sp)
    (_, layer), = linear_modules(model)
    return model, layer


def _fwd_bwd(layer, x, dout):
    out = layer(x.detach().requires_grad_(), **_extra(layer))
    (out[0] if isinstance(out, tuple) else out).backward(dout)


def _extra(layer) -> dict:
    """MiniMax's lightning layer takes position_embeddings and attention_mask positionally (unused in training)."""
    import inspect
    return {k: None for k in ("position_embeddings", "attention_mask")
            if k in inspect.signature(type(layer).forward).parameters}


def _case_fns(args, rank: int):
    """{(family, case): (run fwd+bwd or None on this rank, stats or None)} in a fixed order; models kept
    alive by the closures. ``rank``: the global rank (single runs on rank 0 alone)."""
    import torch
    from ..sequence_parallel import SequenceParallel
    mine = SequenceParallel(dict(strategy="ring", size=args.P)).rank      # halves: this rank's N/P tokens
    fns = {}
    for fam in args.families:
        cfg = family_config(fam, args.hidden)
        g = torch.Generator().manual_seed(1)
        x, dout = (torch.randn(1, args.seq, args.hidden, generator=g) for _ in range(2))
        for case in family_cases(fam, args.sp_cases):
            if case in ("single", "halves"):
                layer = _mixer(cfg)[1]
                xs = (x, dout) if case == "single" else tuple(t.chunk(args.P, 1)[mine].clone() for t in (x, dout))
                run = None if case == "single" and rank != 0 else \
                    (lambda layer=layer, xs=xs: _fwd_bwd(layer, *xs))
                fns[fam, case] = (run, None)
                continue
            sp = SequenceParallel(dict(strategy="ring", size=args.P, backend="torch", **SP_CASES[case]))
            layer = _mixer(cfg, sp)[1]
            xs = tuple(sp.shard(t, dim=1).clone() for t in (x, dout))
            fns[fam, case] = (lambda layer=layer, xs=xs: _fwd_bwd(layer, *xs), sp.stats)
    return fns


def bench_rank(args) -> Dict[str, object]:
    """Every rank: the interleaved rounds; then rank 0 alone times the ops (op_pieces)."""
    return rank_rounds(args, _case_fns, ("ops", op_pieces) if args.op_rounds else None)


# -- the local op alone ------------------------------------------------------------------------------

OP_FAMILIES = {"gdn": "torch_chunk_gated_delta_rule", "kda": "chunk_kimi_delta_attention", "ssd": "mamba2_chunk_scan"}


def _captured_call(fam: str, args):
    """(the original op, its arguments as the unapplied layer calls it on N/P tokens)."""
    import inspect
    import torch
    _, layer = _mixer(family_config(fam, args.hidden))
    module, name = sys.modules[type(layer).__module__], OP_FAMILIES[fam]
    seam = getattr(module, name)
    original = getattr(seam, "_ds_seqpar_original", seam)
    seen = {}

    def capture(*a, **kw):
        seen["args"], seen["kwargs"] = a, kw
        return original(*a, **kw)
    setattr(module, name, capture)
    try:
        with torch.no_grad():
            layer(torch.randn(1, args.seq // args.P, args.hidden, generator=torch.Generator().manual_seed(2)),
                  **_extra(layer))
    finally:
        setattr(module, name, seam)
    bound = inspect.signature(original).bind(*seen["args"], **seen["kwargs"])
    call = dict(bound.arguments)
    call.update(call.pop("kwargs", {}))
    return original, {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in call.items()}


def _op_runs(fam: str, original, call: dict):
    """(plain op fwd+bwd, ds_seqpar's map call(s) fwd+bwd) on the same inputs, gradients for every float input."""
    import torch
    from ..hf.linear.delta_rule import delta_rule_map
    from ..hf.linear.ssd import ssd_map

    def leaves():
        return {k: (v.detach().requires_grad_() if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 1
                    else v) for k, v in call.items()}

    def backward(outs):
        torch.autograd.backward([o for o in outs if o is not None and o.requires_grad],
                                [torch.ones_like(o) for o in outs if o is not None and o.requires_grad])

    names, state, mapped = (("hidden_states", "dt", "B", "C"), ("initial_states", "return_final_states"), ssd_map) \
        if fam == "ssd" else (("query", "key", "value", "g", "beta"), ("initial_state", "output_final_state"),
                              delta_rule_map)

    def plain():
        out = original(**leaves())
        backward([out[0] if isinstance(out, tuple) else out])

    def widened():
        kw = {k: v for k, v in leaves().items() if k not in state}
        backward(mapped(original, *[kw.pop(n) for n in names], kw))
    return plain, widened


def op_pieces(args) -> List[dict]:
    rows = []
    for fam in [f for f in args.families if f in OP_FAMILIES]:
        plain, mapped = _op_runs(fam, *_captured_call(fam, args))
        t = alone({"plain": plain, "map": mapped}, args.op_rounds, warmup=1)
        ratios = [m / p for m, p in zip(t["map"], t["plain"])]
        rows.append({"family": fam, "op": OP_FAMILIES[fam], "tokens": args.seq // args.P,
                     "plain": statistics.median(t["plain"]), "map": statistics.median(t["map"]),
                     "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)]})
    return rows


# -- the whole training step -------------------------------------------------------------------------


def equal_llama(path: str) -> dict:
    """A Llama config with the sizes of the config at ``path``: width, MLP, depth, heads, k/v heads,
    head size, vocabulary and tying (every layer softmax attention)."""
    with open(path if path.endswith(".json") else os.path.join(path, "config.json")) as f:
        src = json.load(f)
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "tie_word_embeddings", "max_position_embeddings", "rms_norm_eps",
            "initializer_range")
    return dict({k: src[k] for k in keys if k in src}, model_type="llama", architectures=["LlamaForCausalLM"],
                use_cache=False, attention_dropout=0.0)


def measure_train(args) -> Dict[str, dict]:
    """{label: measure_training's result for zigzag} for the hybrid and its equal Llama."""
    from .train_step import measure_training
    with tempfile.TemporaryDirectory(prefix="ds_seqpar_bench_hybrid_") as tmp:
        llama = os.path.join(tmp, "llama_equal.json")
        with open(llama, "w") as f:
            json.dump(equal_llama(args.train_model), f)
        models = {os.path.basename(args.train_model): os.path.abspath(args.train_model), "llama (equal sizes)": llama}
        with fresh_pool(args.P) as pool, fresh_pool(1) as solo:
            return {label: measure_training(pool, solo, ["zigzag"], dict(seq_len=args.train_seq, micro_batch=1,
                                                                          steps=3, model=path), 1,
                                            args.train_repeats)["zigzag"]
                    for label, path in models.items()}


# -- the rows ------------------------------------------------------------------------------------------


def rows(per_rank, args, meta, ops: Optional[List[dict]], train: Optional[Dict[str, dict]]) -> List[Row]:
    """Per family and case the layer's speedup over single (per round, harness.versus) and its bytes against
    the closed form; the local op alone; the whole training step."""
    layer, out, sent = f"One layer, fwd+bwd at N={meta['seq']}, P={meta['P']}", [], []
    for fam in args.families:
        times = {case: case_times(per_rank, f"{fam}/{case}") for case in family_cases(fam, args.sp_cases)}
        for case, x in times.items():
            s = versus(times["single"], x)
            out.append(Row("hybrid", fam, case, layer, "x", s["ratio"], tuple(s["ratio_range"]),
                           target="hybrid_layer" if case.startswith("lasp") else None,
                           detail={"wall s": x["time"], "CPU speedup": s["cpu_ratio"], "CPU s per rank": x["cpu"]}))
        for other in ("lasp_allgather", "lasp_ring"):      # paired per round: the exchanges against each other
            if "lasp_allscan" in times and other in times:
                vs = versus(times["lasp_allscan"], times[other])
                out.append(Row("hybrid", fam, f"lasp_allscan / {other}", f"All-Scan against the other LASP exchanges, "
                               f"one layer at N={meta['seq']}, P={meta['P']}: time ratio", "x", vs["ratio"],
                               tuple(vs["ratio_range"]), detail={"busiest-rank CPU ratio": vs["cpu_ratio"]}))
        sent += [Row("hybrid", fam, case, "Bytes per rank of one layer against the closed form", "B", x["bytes"],
                     predicted=layer_bytes(fam, case, args), target="bytes")
                 for case, x in times.items() if case in SP_CASES]
    out += sent
    for o in ops or []:
        out.append(Row("hybrid", o["family"], f"`{o['op']}`", f"The local op alone, {o['tokens']} tokens (N/P): map "
                       f"/ plain", "x", o["ratio"], tuple(o["ratio_range"]),
                       detail={"plain CPU s": o["plain"], "map CPU s": o["map"]}))
    out += [step_row("hybrid", label, f"P={meta['P']} vs 1", f"Whole training step at {meta['train_seq']} tokens, "
                     "ZeRO-2", t) for label, t in (train or {}).items()]
    return out


def facts(meta) -> dict:
    listed = "; ".join(f"`{fam}`: {FAMILIES[fam][0]} (`{FAMILIES[fam][1]}`), {family_sizes(fam, meta['hidden'])}"
                       for fam in meta["families"])
    return suite_facts(
        meta, "Hybrid models' linear layers on CPU ranks: one transformers layer, sharded vs unsharded",
        f"P={meta['P']} ranks x 1 thread (gloo), N={meta['seq']} tokens, batch 1, hidden {meta['hidden']}, "
        f"fp32, forward + backward of ONE layer: the model's own mixer module (transformers "
        f"{meta.get('transformers', '?')}, its torch fallbacks), applied by ds_seqpar with softmax strategy "
        f"ring; speedup = single / case. Families: {listed}.", {
            f"One layer, fwd+bwd at N={meta['seq']}, P={meta['P']}":
                "single: rank 0, the unapplied layer on all N tokens (the baseline). halves: every rank the "
                "unapplied layer on its N/P tokens, nothing exchanged: the bound no exact split beats here.",
            "Bytes per rank of one layer against the closed form":
                "What CommStats recorded per rank for one fwd+bwd against the cost model's "
                "(`cost.bytes.linear_layer_bytes` on the shape read from the family's config: "
                "strategies/closed_form.py's `linear_state_bytes`, `conv_halo_bytes`, `linear_ulysses_bytes`).",
            f"Whole training step at {meta.get('train_seq')} tokens, ZeRO-2":
                "Through train.run_training: zigzag for the softmax layers, linear_strategy lasp (allgather) for the "
                "linear ones; rounds alternate the 1-rank and the P-rank run. The Llama has the hybrid's sizes."},
        rounds=True)


# -- command line ----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = suite_parser(PROG, __doc__, "hybrid_cpu", P=2, seq=8192)
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma list of {', '.join(FAMILIES)}")
    ap.add_argument("--hidden", type=int, default=512, help="the layer's hidden size")
    ap.add_argument("--sp-cases", default=",".join(SP_CASES), help=f"comma list of {', '.join(SP_CASES)} (ulysses "
                    f"needs the family's heads divisible by P)")
    ap.add_argument("--op-rounds", type=int, default=3, help="rounds of the op-alone timing on rank 0 (0: skip)")
    ap.add_argument("--train-model", default=os.path.join("configs", "models", "qwen3_5_small.json"),
                    help="the hybrid of the training-step comparison (a config JSON or model directory)")
    ap.add_argument("--train-seq", type=int, default=4096)
    ap.add_argument("--train-repeats", type=int, default=3, help="measured training rounds (0: skip the training step)")
    return ap


def resolve(args) -> argparse.Namespace:
    args.families = tuple(f for f in args.families.split(",") if f)
    bad = [f for f in args.families if f not in FAMILIES]
    if bad or not args.families:
        raise SystemExit(f"{PROG}: --families {bad or args.families}: choose from {', '.join(FAMILIES)}")
    args.sp_cases = tuple(c for c in args.sp_cases.split(",") if c)
    bad = [c for c in args.sp_cases if c not in SP_CASES]
    if bad or not args.sp_cases:
        raise SystemExit(f"{PROG}: --sp-cases {bad or args.sp_cases}: choose from {', '.join(SP_CASES)}")
    if args.P < 2 or args.seq % args.P or args.repeats < 1 or args.warmup < 0:
        raise SystemExit(f"{PROG}: --P {args.P} must be >= 2 and divide --seq {args.seq}; --repeats >= 1, "
                         f"--warmup >= 0")
    if args.train_repeats and not os.path.exists(args.train_model):
        raise SystemExit(f"{PROG}: --train-model {args.train_model!r} does not exist")
    return args


def write(found: List[Row], meta, out: str) -> int:
    return write_page(out, meta["name"], found, dict(facts(meta), meta=meta), PROG)


def measure(args, argv: List[str]) -> int:
    import transformers
    per_rank, meta = measure_on_pool(bench_rank, resolve(args), command_line(PROG, argv), versions=True)
    train = None
    if args.train_repeats:
        train = measure_train(args)
        meta.update(load_after=" ".join(f"{x:.2f}" for x in os.getloadavg()))
    meta.update(transformers=transformers.__version__)
    return write(rows(per_rank, args, meta, per_rank[0].get("ops"), train), meta, args.out)


def main(argv: Optional[List[str]] = None) -> int:
    return suite_main(argv, build_parser(), measure)
