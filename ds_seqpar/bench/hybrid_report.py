"""The page of ``ds-seqpar bench --hybrid`` (hybrid.py measures): one layer per family sharded vs
unsharded, the local op alone, the whole training step; ``--render`` re-writes it from the JSON."""
from __future__ import annotations

from typing import Dict, List, Optional

from .hybrid import FAMILIES, GOAL, family_config
from .machine import run_lines


def _sizes(fam: str, hidden: int) -> str:
    c = family_config(fam, hidden)
    keys = {"gdn": ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                    "linear_conv_kernel_dim"),
            "kda": ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"),
            "ssd": ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_chunk_size", "mamba_d_conv"),
            "lightning": ("num_attention_heads", "head_dim", "block_size"), "conv": ("conv_L_cache",)}[fam]
    return ", ".join(f"{k}={getattr(c, k)}" for k in keys)


def render(rows: Dict[str, dict], meta, ops: Optional[List[dict]], train: Optional[Dict[str, dict]]) -> str:
    from .markdown import _spread
    from .window import _j, _t
    ok = lambda good: "**PASS**" if good else "**SHORT**"  # noqa: E731
    p = meta["P"]
    lines = [
        "# Hybrid models' linear layers on CPU ranks: one transformers layer, sharded vs unsharded", "",
        f"P={p} ranks x 1 thread (gloo), N={meta['seq']} tokens, batch 1, hidden {meta['hidden']}, fp32, forward + "
        f"backward of ONE layer: the model's own mixer module (transformers {meta.get('transformers', '?')}, its "
        f"torch fallbacks: no fla / mamba_ssm / causal_conv1d kernels on CPU), applied by ds_seqpar with softmax "
        f"strategy ring (one contiguous run per rank). {meta['repeats']} interleaved rounds after {meta['warmup']} "
        f"warm-up round(s), every case once per round after a barrier; times are medians (min-max) of the slowest "
        f"rank's wall time; speedup = single / case per round, median (min-max); CPU speedup: the same with the "
        f"busiest rank's thread CPU time.", "",
        *run_lines(meta),
        "Families (sizes of the one layer):", ""]
    lines += [f"- `{fam}`: {FAMILIES[fam][0]} (`{FAMILIES[fam][1]}`), {_sizes(fam, meta['hidden'])}" for fam in rows]
    lines += ["", f"## One layer, fwd+bwd at N={meta['seq']}, P={p}", "",
              f"single: rank 0, the unapplied layer on all N tokens (the baseline). halves: every rank the unapplied "
              f"layer on its N/P tokens, nothing exchanged: not the layer over the sequence, but the bound no exact "
              f"split beats on this machine. Goal: LASP speedup >= {GOAL} at P=2. Bytes: what CommStats recorded per "
              f"rank for one fwd+bwd against strategies/closed_form.py (`linear_state_bytes`, `conv_halo_bytes`, "
              f"`linear_ulysses_bytes`); must be 1.000.", "",
              "| family | case | wall s | speedup | CPU speedup | CPU s per rank | bytes per rank | closed form | "
              "measured / form | goal |", "|---|---|---|---|---|---|---|---|---|---|"]
    for fam, r in rows.items():
        for case, x in r.items():
            goal = f">= {GOAL}: {ok(x['speedup'] >= GOAL)}" if case.startswith("lasp") else ""
            lo, hi = x["speedup_range"]
            lines.append(f"| {fam} | {case} | {_t(x)} | {x['speedup']:.2f} ({lo:.2f}-{hi:.2f}) | {x['cpu_speedup']:.2f} | "
                         f"{_j(x['cpu'], '{:.3f}')} | {_j(x.get('bytes', []))} | {_j(x.get('form', []))} | "
                         f"{_j(x.get('bytes_ratio', []), '{:.3f}')} | {goal} |")
    if ops:
        lines += ["", f"## The local op alone: plain vs the map ds_seqpar computes, {ops[0]['tokens']} tokens (N/P)", "",
                  "Rank 0 after the rounds, one thread: the op as the unapplied layer calls it (inputs captured from "
                  "that call), forward + backward, against the call(s) `linear_strategy: lasp` makes on the same "
                  "inputs for a run's affine map: the delta rule's widened call (`delta_rule_map`: values [v, 0_K], "
                  "initial state [0, I_K]), Mamba2's plain call plus a width-1 probe of the decays (`ssd_map`). "
                  f"Median CPU s of {meta['op_rounds']} alternating rounds; ratio per round, median (min-max).", "",
                  "| family | op | plain CPU s | map CPU s | map / plain |", "|---|---|---|---|---|"]
        lines += [f"| {o['family']} | `{o['op']}` | {o['plain']:.3f} | {o['map']:.3f} | {o['ratio']:.2f} "
                  f"({o['ratio_range'][0]:.2f}-{o['ratio_range'][1]:.2f}) |" for o in ops]
    if train:
        lines += ["", f"## Whole training step at {meta['train_seq']} tokens, ZeRO-2, sp={p} vs one rank", "",
                  "Through train.run_training (train_step.measure_training): zigzag for the softmax layers, "
                  "linear_strategy lasp (allgather) for the linear ones; 3 steps per run (the first is warm-up), "
                  f"1 warm-up + {meta['train_repeats']} rounds alternating the 1-rank and the {p}-rank run; the "
                  f"{p}-rank losses equal the 1-rank ones (rel. 1e-4). The Llama has the hybrid's sizes (width, MLP, "
                  "depth, heads, vocabulary), every layer softmax attention. Compute speedup: the busiest rank's "
                  "fwd+bwd CPU time, 1 rank over P.", "",
                  f"| model | 1 rank s/step | {p} ranks s/step | speedup (min-max) | compute speedup | tokens/s 1 -> {p} "
                  "| losses, max rel diff |", "|---|---|---|---|---|---|---|"]
        for label, t in train.items():
            lines.append(f"| {label} | {_spread(t['one_s'], 3)} | {_spread(t['p_s'], 3)} | {_spread(t['speedup'])} | "
                         f"{_spread(t['compute_speedup'])} | {t['tokens_per_s'][0]:.0f} -> {t['tokens_per_s'][1]:.0f} | "
                         f"{t['loss_rel_diff']:.1e} |")
    lines += ["", meta.get("notes", ""), ""]
    return "\n".join(lines)


__all__ = ["render"]
