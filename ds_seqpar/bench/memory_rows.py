"""The memory suite's results (bench/memory.py, summarised by memory_summary.py's phase model) as
rows: the goals (features against the plain step and the floor, P=2 against P=1, every strategy
against P=1, the features' step time against the recompute they imply), then every variant,
measurement and phase, with the facts a reader needs around them."""
from __future__ import annotations

from typing import Any, Dict, List

from ..report.rows import Row
from .memory_summary import KIB, MIB, key

FEATURES = "Bytes per token per rank: with the features / without"
FLOOR = "Bytes per token per rank with the features / the floor (layers x hidden x 4 B)"
PEAK = "Step peak per rank, P=2 / P=1 at equal tokens per rank"
ABOVE = "Forward+backward peak above static, P=2 / P=1 at equal tokens per rank"
LONGEST = "Longest sequence in the budget with the features, P=2 / P=1"
STRATEGIES = "Every strategy: the whole step's peak above static at P ranks / one rank's, equal tokens per rank"
TWO_POINT = "Why a two-point figure misleads (zigzag): (peak at N - peak at a short length) / (N - short), KiB"
VARIANTS = "Bytes per token per rank (KiB, the largest phase slope) and the longest sequence"
POINTS = "Every measurement: peak per rank of the whole step (MiB)"
PHASES = "Bytes per token of each phase (KiB, fitted slope)"
TIMING = "Step time at a short sequence: with / without the features (predicted: the recompute's implied ratio)"


def _goals(variants: Dict[str, Dict[str, Any]]) -> List[Row]:
    out = []
    for model in sorted({v["model"] for v in variants.values()}):
        for p in sorted({v["world"] for v in variants.values() if v["model"] == model}):
            on, off = variants.get(key(model, p, True)), variants.get(key(model, p, False))
            if on and off:
                out.append(Row("memory", model, f"P={p}", FEATURES, "x", on["bytes_per_token"] / off["bytes_per_token"],
                               target="memory.features_vs_plain"))
            if on:
                out.append(Row("memory", model, f"P={p}", FLOOR, "x", on["floor_ratio"], target="memory.features_vs_floor"))
        for features in (True, False):
            one, two = variants.get(key(model, 1, features)), variants.get(key(model, 2, features))
            if not (one and two):
                continue
            at = {r["tokens_per_rank"]: r for r in one["rows"]}
            tag = "with" if features else "without"
            for r2 in (r for r in two["rows"] if r["tokens_per_rank"] in at):
                r1, n = at[r2["tokens_per_rank"]], r2["tokens_per_rank"]
                out.append(Row("memory", model, f"{tag} features, {n} tokens/rank", PEAK, "x",
                               r2["peak_bytes"] / r1["peak_bytes"], target="memory.peak_p2_vs_p1"))
                # what the tokens cost, without the static part (ZeRO shards the optimizer over P)
                out.append(Row("memory", model, f"{tag} features, {n} tokens/rank", ABOVE, "x",
                               r2["activation_bytes"] / r1["activation_bytes"], target="memory.p2_vs_p1"))
            if features and one["max_seq_len"] and two["max_seq_len"]:
                out.append(Row("memory", model, "with features", LONGEST, "x", two["max_seq_len"] / one["max_seq_len"],
                               target="memory.max_seq"))
    return out


def _strategies(comp: Dict[str, Any]) -> List[Row]:
    out = []
    for r in comp.get("rows", []):
        target = {2: "memory.strategy_p2", 4: "memory.strategy_p4"}.get(r["world"]) if r["vs_p1"] is not None else None
        out.append(Row("memory", r["strategy"], f"P={r['world']}, {r['tokens_per_rank']} tokens/rank", STRATEGIES, "x",
                       r["vs_p1"], target=target, detail=dict(
                           {"static MiB": r["static_bytes"] / MIB, "peak MiB": r["peak_bytes"] / MIB,
                            "above static MiB": r["above_static_bytes"] / MIB, "peak phase": r["peak_phase"]},
                           **{f"{p} MiB": b / MIB for p, b in r["phase_above_static_bytes"].items()})))
    out += [Row("memory", f"P={t['world']}", f"{t['short_tokens']} -> {t['tokens_per_rank']} tokens/rank", TWO_POINT,
                "KiB", t["per_token"] / KIB, detail={
                    "peak at short MiB": t["short_peak_bytes"] / MIB, "its phase": t["short_peak_phase"],
                    "peak MiB": t["peak_bytes"] / MIB, "above static / token KiB": t["above_static_per_token"] / KIB})
            for t in comp.get("two_point", [])]
    return out


def rows(res: Dict[str, Any]) -> List[Row]:
    variants, floor = res["variants"], res["meta"]["layers"] * res["meta"]["hidden"] * 4
    out = _goals(variants) + _strategies(res.get("strategy_rows") or {})
    out += [Row("memory", "step", f"{r['case']}, {r['tokens_per_rank']} tokens/rank", TIMING, "x", r["ratio"],
                (r["ratio_min"], r["ratio_max"]), predicted=r["implied"], target="memory.time_vs_implied",
                detail={"without s": r["off_s"], "with s": r["on_s"], "rounds": r["rounds"]})
            for r in res.get("timing_rows") or []]
    for v in variants.values():
        label = f"P={v['world']} {'on' if v['features'] else 'off'}"
        out.append(Row("memory", v["model"], label, VARIANTS, "KiB", v["bytes_per_token"] / KIB, detail={
            "x floor": v["bytes_per_token"] / floor, "phase": v["dominant_phase"],
            "static MiB": v["rows"][0]["resident_bytes"] / MIB, "longest tokens/rank": v["max_tokens_per_rank"],
            "longest sequence": v["max_seq_len"], "fit residual MiB": v["fit_max_residual"] / MIB}))
    for v in variants.values():
        label = f"P={v['world']} {'on' if v['features'] else 'off'}"
        out += [Row("memory", v["model"], f"{label}, {r['tokens_per_rank']} tokens/rank", POINTS, "MiB",
                    r["peak_bytes"] / MIB, detail={
                        "static MiB": r["resident_bytes"] / MIB, "peak phase": r["peak_phase"],
                        "fwd+bwd above static MiB": r["activation_bytes"] / MIB,
                        "above static / token KiB": r["above_static_per_token"] / KIB,
                        "marginal / token KiB": None if r["marginal_per_token"] is None else r["marginal_per_token"] / KIB,
                        "step s": r["step_s"]}) for r in v["rows"]]
    out += [Row("memory", v["model"], f"P={v['world']} {'on' if v['features'] else 'off'}", PHASES, "KiB",
                v["bytes_per_token"] / KIB, detail={p: m["b"] / KIB for p, m in v["phase_model"].items()})
            for v in variants.values()]
    return out


def facts(res: Dict[str, Any]) -> Dict[str, Any]:
    m, mach = res["meta"], res.get("machine", {})
    floor = m["layers"] * m["hidden"] * 4
    malloc = ("glibc malloc with MALLOC_MMAP_THRESHOLD_=65536 (the resident set follows live tensors)"
              if m["malloc"] == "mmap" else "glibc malloc defaults")
    return {
        "title": f"Memory of a training step per rank: `{m['name']}`",
        "setup": f"Model: vocab {m['vocab']}, hidden {m['hidden']}, {m['layers']} layers, {m['heads']} heads "
                 f"({m['kv_heads']} k/v), MLP {m['intermediate']}; `llama` = Hugging Face LlamaForCausalLM from a "
                 f"LlamaConfig, `lm` = the project's LM with the same sizes. DeepSpeed ZeRO-2, fp32, AdamW, strategy "
                 f"{m['strategy']}, micro batch 1, one thread per rank, CPU (gloo). With the features: fused tiled "
                 f"loss ({m['tiled_loss_tokens']} tokens per chunk), tiled MLP ({m['tiled_mlp_tokens']}), "
                 f"checkpointing of every decoder layer. Each point runs the main job in fresh processes; peak = the "
                 f"process's resident high-water mark (VmHWM), reset per phase (data, forward, loss backward, layers "
                 f"backward, end of backward, optimizer step); allocator: {malloc}. *Static* = the resident set just "
                 f"before the step. Each phase's peak is affine in the tokens per rank N; bytes/token = the largest "
                 f"slope; the longest sequence in the budget ({m['budget_bytes'] / 2 ** 30:.2f} GiB per rank) solves "
                 f"peak(N) = budget. Floor = layers x hidden x 4 B = {floor / KIB:.0f} KiB per token.",
        "command": m["command"], "notes": "; ".join(res.get("skipped") or []) and
        "Not measured: " + "; ".join(res["skipped"]),
        "machine": f"{mach.get('cpu_model', '?')}, {mach.get('cpus', '?')} cores (shared); torch "
                   f"{mach.get('torch', '?')}, deepspeed {mach.get('deepspeed', '?')}; whole run "
                   f"{res.get('elapsed_s', 0) / 60:.0f} min. Memory high-water marks do not depend on the load; step "
                   f"times do.",
        "metrics": {
            TIMING: "Both variants alternate round by round in the same processes; per round the median of its steps, "
                    "the slowest rank's. Implied: the ratio of the step's matmul multiply-accumulates with and without "
                    "the features (the recompute), elementwise work not counted.",
            POINTS: "above static per token = (peak - static) / N; marginal = the peak's rise per token from the "
                    "previous length; fwd+bwd above static = the highest forward or backward phase minus static."},
        "images": [(p, f"{m['name']}/{p}.png") for p in ("bytes_per_token", "peak_per_rank") if res["variants"]]}


__all__ = ["rows", "facts"]
