"""``--calibrate`` at P = 4: what can be checked on this machine, and what cannot.

Time is not: the machine has 2 cores, and 4 ranks of one thread each share them, so a P = 4 time
measures the oversubscription (two ranks per core, taking turns), not the strategy; no P = 4 time is
predicted against a measurement. Bytes and memory do not depend on the cores:

    bytes   the plan's bytes per rank (cost.bytes.rank_bytes, which cost.bytes.comm_per_layer reads
            through busiest_bytes) against closed_form_by_kind rank by rank, every softmax strategy and
            the 2D hybrid, plain and with each window of reports/window_cpu.json; must be equal
    memory  the bytes per token per rank of every phase of a training step at P = 4 (the slopes of
            reports/memory_cpu.json's P = 4 rows) against the plan's count (memory.per_token)
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from ..strategies.closed_form import Shapes
from .calibrate_window import form_bytes, plan_bytes
from .cost import memory
from .cost.candidate import Features
from .model_shape import ModelShape

P = 4
# (strategy, ulysses size): every softmax strategy, Ulysses over all 4 ranks, and the 2D hybrid
LAYOUTS = (("ulysses", 4), ("ring", 1), ("zigzag", 1), ("striped", 1), ("zigzag", 2))


def bytes_rows(seq: int = 8192, heads: int = 8, head_dim: int = 64, windows: Sequence[int] = (1024, 2048)
               ) -> List[Dict[str, Any]]:
    """Per (strategy, U, window): the plan's bytes per rank and the closed form's, at P = 4, fp32."""
    shapes = Shapes(1, seq, heads, heads, head_dim)
    rows = []
    for strategy, u in LAYOUTS:
        for w in (None,) + tuple(windows):
            rows.append({"strategy": strategy, "ulysses": u, "window": w, "plan": plan_bytes(strategy, P, u, shapes, w),
                         "form": form_bytes(strategy, P, u, shapes, w)})
    return rows


def measured_variants(report: Dict[str, Any], world: Optional[int] = None):
    """(label, measurements, shape, features) of every memory_cpu variant measured at two lengths or more
    (the scaling runs; P = ``world`` only, when given), with the shape and features the plan counts it by."""
    groups: Dict[tuple, list] = {}
    for m in report.get("measurements", []):
        if m.get("purpose") in (None, "scaling") and world in (None, m["world"]):
            groups.setdefault((m["model"], m["world"], m["features"]), []).append(m)
    for (model, p, features), ms in sorted(groups.items()):
        if len({m["tokens_per_rank"] for m in ms}) < 2:
            continue
        m = ms[0]
        shape = ModelShape(model, m["hidden"], m["layers"], m["heads"], m["kv_heads"], m["hidden"] // m["heads"],
                           m["intermediate"], m["vocab"], tied=model != "llama")
        f = Features(on=features, cpu_checkpointing=False, tiled_loss_tokens=m["tiled_loss_tokens"],
                     tiled_mlp_tokens=m["tiled_mlp_tokens"])
        yield f"{model}/P{p}/{'on' if features else 'off'}", ms, shape, f


def memory_rows(report: Dict[str, Any], world: int = P) -> List[Dict[str, Any]]:
    """Per P = ``world`` variant of memory_cpu measured at two lengths or more (the scaling runs), per
    phase: the measured bytes per token per rank (slope of the phase's peak) and the plan's."""
    rows = []
    for variant, ms, shape, f in measured_variants(report, world):
        lengths = sorted({m["tokens_per_rank"] for m in ms})
        ours, fitted = memory.per_token(shape, 4, f, True), memory.phase_model(ms)
        for phase in ("forward", "loss_backward", "layers_backward"):
            rows.append({"variant": variant, "phase": phase, "lengths": lengths, "measured": fitted[phase]["b"],
                         "predicted": ours[phase]})
        rows.append({"variant": variant, "phase": "step (largest slope)", "lengths": lengths,
                     "measured": max(r["measured"] for r in rows[-3:]),
                     "predicted": max(ours[p] for p in ("forward", "loss_backward", "layers_backward"))})
    return rows


__all__ = ["LAYOUTS", "P", "bytes_rows", "measured_variants", "memory_rows"]
