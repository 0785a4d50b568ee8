"""The one renderer: rows (report/rows.py) of any suite to a markdown page.

A page is the run's facts (what ran, the command, the machine and its load), the targets table (every
row that names a target, with its verdict), then one table per metric in the order the suite emitted
them: case, variant, the measured value (min-max over rounds), and only the columns some row of that
table fills (predicted, measured / predicted, bound, target, each detail key). A suite says what a
metric means in ``facts["metrics"]``; a new measurement is new rows, not a new renderer.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence

from .rows import Row, save_rows
from .targets import TARGETS, verdict


def fmt(x: Any, unit: str = "") -> str:
    """One cell: per-rank lists "a / b", integers as they are, seconds and ratios with 3 decimals."""
    if x is None:
        return ""
    if isinstance(x, (list, tuple)):
        return " / ".join(fmt(v, unit) for v in x)
    if isinstance(x, bool) or isinstance(x, str):
        return str(x)
    if isinstance(x, int) or (unit in ("B", "tokens") and float(x).is_integer()):
        return str(int(x))
    if abs(x) >= 1000:
        return f"{x:.0f}"
    return f"{x:.3f}" if abs(x) >= 1e-3 or x == 0 else f"{x:.1e}"


def _value(r: Row) -> str:
    cell = fmt(r.value, r.unit)
    return cell if r.spread is None else f"{cell} ({fmt(r.spread[0], r.unit)}-{fmt(r.spread[1], r.unit)})"


def _ratio(r: Row) -> str:
    return "" if r.predicted is None or r.value is None else " / ".join(f"{x:.3f}" for x in r.ratios())


def checked(r: Row) -> List[float]:
    """What the row's target is checked on: the value(s), or measured / predicted."""
    return r.ratios() if TARGETS[r.target].of_predicted else r.values()


def result(r: Row) -> str:
    return verdict(r.target, checked(r), r.bound) if r.target else ""


def _table(rows: List[Row]) -> List[str]:
    cols = [("case", lambda r: r.case), ("variant", lambda r: r.variant)]
    if any(r.value is not None for r in rows):            # a table of facts (training runs) has no value column
        cols.append((f"value{' ' + rows[0].unit if rows[0].unit not in ('', 'x') else ''}", _value))
    if any(r.predicted is not None for r in rows):
        cols += [("predicted", lambda r: fmt(r.predicted, r.unit)), ("measured / predicted", _ratio)]
    if any(r.bound is not None for r in rows):
        cols.append(("bound", lambda r: fmt(r.bound)))
    if any(r.target for r in rows):
        cols += [("target", lambda r: TARGETS[r.target].text(r.bound) if r.target else ""),
                 ("result", lambda r: f"**{result(r)}**" if r.target else "")]
    keys = list(dict.fromkeys(k for r in rows for k in r.detail if k != "why"))   # why: the targets table's
    cols += [(k, lambda r, k=k: fmt(r.detail.get(k))) for k in keys]
    out = ["| " + " | ".join(c for c, _ in cols) + " |", "|---" * len(cols) + "|"]
    return out + ["| " + " | ".join(f(r) for _, f in cols) + " |" for r in rows]


def targets_table(rows: Sequence[Row]) -> List[str]:
    held = [r for r in rows if r.target]
    if not held:
        return []
    out = ["## Targets (docs/design.md)", "", "| check | case | variant | measured | bound | target | result | why, "
           "where short |", "|---|---|---|---|---|---|---|---|"]
    exact = [r for r in held if TARGETS[r.target].op == "=="]
    if exact and all(result(r) == "PASS" for r in exact):
        # an exact check that holds everywhere is one line, not one per (case, variant)
        held = [r for r in held if r not in exact]
        for metric in dict.fromkeys(r.metric for r in exact):
            n = sum(r.metric == metric for r in exact)
            out.append(f"| {metric} | every case | {n} rows | {fmt(1.0)} | | {TARGETS[exact[0].target].text()} | "
                       f"**PASS** | |")
    for r in held:
        why = r.detail.get("why", "") if result(r) != "PASS" else ""
        out.append(f"| {r.metric} | {r.case} | {r.variant} | {fmt(max(checked(r)))} | {fmt(r.bound)} | "
                   f"{TARGETS[r.target].text(r.bound)} | **{result(r)}** | {why} |")
    return out + [""]


def render(rows: Sequence[Row], facts: Dict[str, Any]) -> str:
    """facts: title, setup (paragraph), command, machine (a line), metrics {metric: what it means},
    images [(caption, relative path)], notes; every key but title optional."""
    out = [f"# {facts['title']}", ""]
    for key, label in (("setup", ""), ("command", "Command: "), ("machine", "Machine: "), ("notes", "Notes: ")):
        if facts.get(key):
            text = f"`{facts[key]}`" if key == "command" else facts[key]
            out += [f"{label}{text}", ""]
    out += targets_table(rows)
    by_metric: Dict[str, List[Row]] = {}
    for r in rows:
        by_metric.setdefault(r.metric, []).append(r)
    for metric, group in by_metric.items():
        out += [f"## {metric}", ""]
        if facts.get("metrics", {}).get(metric):
            out += [facts["metrics"][metric], ""]
        out += _table(group) + [""]
    out += [f"![{caption}]({path})\n" for caption, path in facts.get("images", [])]
    return "\n".join(out)


def write(out_dir: str, name: str, rows: Sequence[Row], facts: Dict[str, Any], prog: Optional[str] = None) -> str:
    """<out>/<name>.rows.json (what ``ds-seqpar report --rows`` re-renders) and <out>/<name>.md."""
    os.makedirs(out_dir, exist_ok=True)
    save_rows(os.path.join(out_dir, f"{name}.rows.json"), rows, facts)
    path = os.path.join(out_dir, f"{name}.md")
    with open(path, "w") as f:
        f.write(render(rows, facts))
    if prog:
        print(f"{prog}: wrote {path}")
    return path


__all__ = ["render", "write", "fmt", "targets_table", "result"]
