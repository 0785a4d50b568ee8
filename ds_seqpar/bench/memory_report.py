"""Markdown page and PNG plots of ``ds-seqpar bench memory`` (from the results dict memory.py
saves as JSON, so a saved file can be re-rendered with ``--render``)."""
from __future__ import annotations

import os
from typing import Any, Dict, List

from ..report.plotting import colors, pyplot, save
from .memory_summary import KIB, MIB, predict_peak

PHASE_NOTE = ("data (the step's batch, sharded); forward; loss backward (fused head + loss, final norm); layers backward (recompute + backward of "
              "every layer); end of backward (embedding, DeepSpeed's last reductions); optimizer step")


def _kib(x) -> str:
    return "" if x is None else f"{x / KIB:.1f}"


def _mib(x) -> str:
    return "" if x is None else f"{x / MIB:.0f}"


def _label(v: Dict[str, Any]) -> str:
    return f"{v['model']} P={v['world']} {'with' if v['features'] else 'without'}"


def _setup(res: Dict[str, Any]) -> List[str]:
    m, mach = res["meta"], res.get("machine", {})
    floor = m["layers"] * m["hidden"] * 4
    malloc = ("glibc malloc with MALLOC_MMAP_THRESHOLD_=65536 (tensors are mapped and unmapped, so the resident set "
              "follows live memory; with glibc's dynamic threshold freed blocks up to 32 MB stay resident)"
              if m["malloc"] == "mmap" else "glibc malloc defaults")
    return [
        f"# Memory of a training step per rank: `{m['name']}`", "",
        f"Model: vocab {m['vocab']}, hidden {m['hidden']}, {m['layers']} layers, {m['heads']} heads "
        f"({m['kv_heads']} k/v heads, GQA), MLP {m['intermediate']}; `llama` = Hugging Face LlamaForCausalLM built "
        f"from a LlamaConfig (random init, sdpa attention), `lm` = the project's LM with the same sizes (the "
        f"models the command measured: {', '.join(sorted({x['model'] for x in res['measurements']}))}). DeepSpeed "
        f"ZeRO-2, fp32, AdamW, strategy {m['strategy']}, micro batch 1, one thread per rank, CPU (gloo).", "",
        f"With the features: fused tiled loss ({m['tiled_loss_tokens']} tokens per chunk), tiled MLP "
        f"({m['tiled_mlp_tokens']} tokens per chunk), activation checkpointing of every decoder layer with "
        f"`cpu_checkpointing` (on CPU the checkpoints are already in host memory: the offload hooks run, nothing "
        f"moves). Without: the plain step (full logits, every activation saved).", "",
        "**Measurement.** Each point runs the main job itself (`run_training`: its data, model, DeepSpeed engine "
        "and training step) in fresh processes (a new pool of P ranks): its first step creates every buffer a step "
        "keeps (gradient buckets, Adam's moments), the second is measured. Peak = the kernel's high-water mark of the process's resident set (VmHWM in /proc/self/status), "
        f"reset at each phase boundary through /proc/self/clear_refs, so each phase's peak is known ({PHASE_NOTE}); "
        f"the step's peak is the largest. Allocator: {malloc}. *Static* = the resident set just before the step "
        "(weights, gradient buffers, optimizer state, runtime). The per-rank figure is the largest rank's.", "",
        "**Bytes per token.** Each phase's peak is affine in the tokens per rank N (a fixed part plus bytes per token "
        "times N); fitting every phase over the measured lengths gives peak(N) = max over phases (a + b N). The "
        "step's *bytes/token per rank* is the largest slope b: what every further token costs once sequences are long "
        "(at the shorter lengths a fixed-size phase, usually the optimizer step, can hold the peak, so the raw "
        "peaks rise more slowly). The longest sequence in the budget solves peak(N) = budget. "
        f"Floor = layers x hidden x 4 bytes = {floor / KIB:.0f} KiB per token (the checkpointed residual stream).", "",
        f"Command: `{m['command']}`", "",
        f"Machine: {mach.get('cpu_model', '?')}, {mach.get('cpus', '?')} cores (shared); "
        f"torch {mach.get('torch', '?')}, "
        f"deepspeed {mach.get('deepspeed', '?')}; whole run {res.get('elapsed_s', 0) / 60:.0f} min. Memory "
        "high-water marks do not depend on the machine's load; step times do (see the timing section).", ""]


def _checks(res) -> List[str]:
    lines = ["## Goals", "", "| check | measured | goal | result |", "|---|---:|---:|---|"]
    lines += [f"| {c['what']} | {c['measured']:.3f} | {c['target']} | {c['result']} |" for c in res["checks"]]
    return lines + [""]


def _variants(res) -> List[str]:
    budget = res["meta"]["budget_bytes"]
    floor = res["meta"]["layers"] * res["meta"]["hidden"] * 4
    lines = ["## Bytes per token per rank and the longest sequence", "",
             f"Budget: {budget / 2 ** 30:.2f} GiB per rank. Bytes/token: the largest phase slope (see above).", "",
             "| model | P | features | bytes/token/rank (KiB) | x floor | phase | static (MiB) | longest tokens/rank "
             "in budget | longest sequence (P x) | fit residual (MiB) |",
             "|---|---:|---|---:|---:|---|---:|---:|---:|---:|"]
    for v in res["variants"].values():
        static = v["rows"][0]["resident_bytes"]
        lines.append(f"| {v['model']} | {v['world']} | {'on' if v['features'] else 'off'} | "
                     f"{_kib(v['bytes_per_token'])} "
                     f"| {v['bytes_per_token'] / floor:.2f} | {v['dominant_phase']} | {_mib(static)} | "
                     f"{v['max_tokens_per_rank']:,} | {v['max_seq_len']:,} | {v['fit_max_residual'] / MIB:.1f} |")
    return lines + [""]


def _points(res) -> List[str]:
    lines = ["## Every measurement", "",
             "Peak per rank of the whole step; above static per token = (peak - static) / N; marginal = the peak's "
             "rise per token from the previous length; fwd+bwd above static = the highest forward or backward phase "
             "minus static (what the tokens cost, the optimizer step left out).", "",
             "| model | P | features | tokens/rank | static (MiB) | peak (MiB) | peak phase | fwd+bwd above static "
             "(MiB) | above static / token (KiB) | marginal / token (KiB) | step (s) |",
             "|---|---:|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for v in res["variants"].values():
        for r in v["rows"]:
            lines.append(f"| {v['model']} | {v['world']} | {'on' if v['features'] else 'off'} | "
                         f"{r['tokens_per_rank']:,} "
                         f"| {_mib(r['resident_bytes'])} | {_mib(r['peak_bytes'])} | {r['peak_phase']} | "
                         f"{_mib(r['activation_bytes'])} | "
                         f"{_kib(r['above_static_per_token'])} | {_kib(r['marginal_per_token'])} | {r['step_s']:.1f} |")
    lines += ["", "Bytes per token of each phase (KiB, fitted slope):", ""]
    phases = list(next(iter(res["variants"].values()))["phase_model"])
    lines += ["| variant | " + " | ".join(phases) + " |", "|---|" + "---:|" * len(phases)]
    for v in res["variants"].values():
        lines.append(f"| {_label(v)} | " + " | ".join(_kib(v["phase_model"][p]["b"]) for p in phases) + " |")
    return lines + [""]


def _strategies(res) -> List[str]:
    comp = res.get("strategy_rows") or {}
    if not comp.get("rows"):
        return []
    phases = list(comp["rows"][0]["phase_above_static_bytes"])
    lines = ["## Every strategy: the whole step's peak above static, P ranks at P x N against one rank at N", "",
             "The main job (`run_training`, as `python -m ds_seqpar.train` runs it) on a Llama-architecture config "
             "(vocab 32000, hidden 256, 4 layers, 8 q / 2 k/v heads: configs/models/llama_small.json's sizes) with "
             "configs/long_context.json's memory features (tiled loss and tiled MLP 1024 tokens, checkpointing), "
             "ZeRO-2, the same tokens per rank at every P. *Static* = the rank's resident set just before the "
             "measured step; each phase's figure is its peak minus static (the largest rank's). Hybrid = Ulysses 2 x "
             "ring 2.", "",
             "| strategy | P | tokens/rank | static (MiB) | peak (MiB) | above static (MiB) | / P=1 | peak phase | "
             + " | ".join(phases) + " |", "|---|---:|---:|---:|---:|---:|---:|---|" + "---:|" * len(phases)]
    for r in comp["rows"]:
        ratio = "" if r["vs_p1"] is None else f"{r['vs_p1']:.3f}"
        lines.append(f"| {r['strategy']} | {r['world']} | {r['tokens_per_rank']:,} | {_mib(r['static_bytes'])} | "
                     f"{_mib(r['peak_bytes'])} | {_mib(r['above_static_bytes'])} | {ratio} | {r['peak_phase']} | "
                     + " | ".join(_mib(r["phase_above_static_bytes"][p]) for p in phases) + " |")
    if comp.get("two_point"):
        lines += ["", "**Why a two-point figure misleads.** (peak at N - peak at a short length) / (N - short) is "
                  "not what a token costs: at the short length a fixed phase holds the peak (at P=1 the optimizer "
                  "step, whose transient is twice P=2's with nothing sharded; at P=2 the end of backward, ZeRO's "
                  "reduction buckets), so the subtraction removes more than the static part, and more at P=1. "
                  "Zigzag:", "",
                  "| P | short tokens/rank | peak at short (MiB) | its phase | tokens/rank | peak (MiB) | two-point "
                  "KiB/token | above static / token (KiB) |", "|---:|---:|---:|---|---:|---:|---:|---:|"]
        for t in comp["two_point"]:
            lines.append(f"| {t['world']} | {t['short_tokens']:,} | {_mib(t['short_peak_bytes'])} | "
                         f"{t['short_peak_phase']} | {t['tokens_per_rank']:,} | {_mib(t['peak_bytes'])} | "
                         f"{_kib(t['per_token'])} | {_kib(t['above_static_per_token'])} |")
    return lines + [""]


def _timing(res) -> List[str]:
    if not res.get("timing_rows"):
        return []
    lines = ["## Step time at a short sequence", "",
             "Both variants live in the same processes and alternate round by round (load from other processes hits "
             "both alike); per round the median of its steps, the slowest rank's. Checkpointing recomputes every "
             "layer's forward, the tiled MLP recomputes each chunk in the backward (and again inside the "
             "checkpointed recompute), the fused loss recomputes each chunk's logits.", "",
             "*Implied* = the ratio of the step's matmul multiply-accumulates with and without the features "
             "(backward = 2 x forward; the LM head and every layer run one more forward, the MLP two more; "
             "elementwise work not counted): the cost the recompute explains.", "",
             "| case | tokens/rank | without (s) | with (s) | with / without: median (min-max) | implied | rounds |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in res["timing_rows"]:
        lines.append(f"| {r['case']} | {r['tokens_per_rank']:,} | {r['off_s']:.2f} | {r['on_s']:.2f} | "
                     f"{r['ratio']:.2f} "
                     f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) | {r['implied']:.2f} | {r['rounds']} |")
    return lines + [""]


def render_markdown(res: Dict[str, Any], plots: List[str]) -> str:
    lines = _setup(res) + _checks(res) + _strategies(res) + _variants(res) + _points(res) + _timing(res)
    lines += [f"![{os.path.basename(p)}]({res['meta']['name']}/{os.path.basename(p)})" for p in plots] + [""]
    if res.get("skipped"):
        lines += ["## Not measured", ""] + [f"- {s}" for s in res["skipped"]] + [""]
    return "\n".join(lines)


def plot_bytes_per_token(res, path: str) -> str:
    """Bytes per token per rank above static vs tokens per rank: measured points, the phase model's
    curve out to the budget, with and without the features; the floor drawn."""
    plt = pyplot()
    floor = res["meta"]["layers"] * res["meta"]["hidden"] * 4
    models = sorted({v["model"] for v in res["variants"].values()})
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 5.5), squeeze=False)
    by_world = dict(zip((1, 2, 4, 8), colors(4)))
    for ax, model in zip(axes[0], models):
        for v in (v for v in res["variants"].values() if v["model"] == model):
            c, style = by_world.get(v["world"], "k"), "-" if v["features"] else "--"
            static = v["rows"][0]["resident_bytes"]
            xs = [r["tokens_per_rank"] for r in v["rows"]]
            ax.plot(xs, [r["above_static_per_token"] / KIB for r in v["rows"]], "o", color=c)
            top = max(v["max_tokens_per_rank"], max(xs)) if v["max_tokens_per_rank"] > 0 else max(xs)
            grid = [min(xs) * (top / min(xs)) ** (i / 60) for i in range(61)]
            ax.plot(grid, [(predict_peak(v["phase_model"], n) - static) / n / KIB for n in grid], style, color=c,
                    label=f"P={v['world']} {'with' if v['features'] else 'without'} features")
        ax.axhline(floor / KIB, color="k", lw=1.5, ls=":", label=f"floor layers x hidden x 4 B = {floor / KIB:g} KiB")
        ax.axhline(3 * floor / KIB, color="grey", lw=1, ls=":", label="3 x floor")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("KiB per token per rank above static")
        ax.set_title(f"{model}: points measured, lines = phase model up to the budget")
        ax.legend(fontsize=9)
    return save(fig, path)


def plot_peak(res, path: str) -> str:
    plt = pyplot()
    budget = res["meta"]["budget_bytes"]
    fig, ax = plt.subplots(figsize=(10, 5.5))
    palette = colors(len(res["variants"]))
    for i, v in enumerate(res["variants"].values()):
        xs = [r["tokens_per_rank"] for r in v["rows"]]
        top = max(xs + [max(0, v["max_tokens_per_rank"])])
        grid = [min(xs) * (top / min(xs)) ** (j / 60) for j in range(61)]
        ax.plot(xs, [r["peak_bytes"] / MIB for r in v["rows"]], "o", color=palette[i])
        ax.plot(grid, [predict_peak(v["phase_model"], n) / MIB for n in grid], "-" if v["features"] else "--",
                color=palette[i], label=_label(v))
    ax.axhline(budget / MIB, color="k", ls=":", label=f"budget {budget / 2 ** 30:.2f} GiB")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("peak MiB per rank (whole step)")
    ax.set_title("Peak memory per rank: measured points, phase model lines")
    ax.legend(fontsize=8, ncol=2)
    return save(fig, path)


def write_report(res: Dict[str, Any], out: str) -> str:
    plot_dir = os.path.join(out, res["meta"]["name"])
    os.makedirs(plot_dir, exist_ok=True)
    plots = []
    if res["variants"]:
        plots = [plot_bytes_per_token(res, os.path.join(plot_dir, "bytes_per_token.png")),
                 plot_peak(res, os.path.join(plot_dir, "peak_per_rank.png"))]
    path = os.path.join(out, f"{res['meta']['name']}.md")
    with open(path, "w") as f:
        f.write(render_markdown(res, plots))
    return path


__all__ = ["write_report", "render_markdown"]
