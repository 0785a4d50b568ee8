"""What every benchmark measures, as one kind of record: a ``Row`` (one number of one case), saved
as a JSON list and rendered by report/render.py, whichever suite measured it.

A row names where it comes from (suite, case, variant), what it is (metric, unit), the measured value
with its spread over rounds, and what it is held against: the cost model's prediction, the
theoretical bound and the target (a key of report/targets.py). ``value`` is one number, or one per
rank (bytes sent, CPU seconds): the renderer writes those "a / b". The suite is a name of
bench/suites.py's list (the one list of suites; report reads no bench module), "plan" (``plan
--calibrate``) or "train" (report/main.py's training runs).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

Number = Union[float, int]


@dataclass(frozen=True)
class Row:
    suite: str                                     # a bench suite (bench/suites.py, its one list), plan, train
    case: str                                      # a strategy, a baseline, a model family
    variant: str                                   # what the case ran: "N=8192", "window=1024", "P=2 on"
    metric: str                                    # the table the row lands in: "speedup", "bytes / form"
    unit: str = ""                                 # "s", "B", "x" (a ratio), "" (a count)
    value: Union[Number, List[Number], None] = None
    spread: Optional[Tuple[Number, Number]] = None  # min-max over rounds
    predicted: Union[Number, List[Number], None] = None  # what the cost model says (closed form, work ratio)
    bound: Optional[Number] = None                 # what no implementation beats (P, the causal ring bound)
    target: Optional[str] = None                   # key of report.targets.TARGETS
    detail: Dict[str, Any] = field(default_factory=dict)   # anything else a reader needs (why, loads)

    def values(self) -> List[float]:
        return list(self.value) if isinstance(self.value, (list, tuple)) else [self.value]

    def ratios(self) -> List[float]:
        """measured / predicted, per rank where both are lists (1.0 where both are 0)."""
        ps = self.predicted if isinstance(self.predicted, (list, tuple)) else [self.predicted]
        return [v / p if p else float(v == 0) for v, p in zip(self.values(), ps)]


def save_rows(path: str, rows: Sequence[Row], facts: Dict[str, Any]) -> None:
    """``{"facts": ..., "rows": [...]}``: the run's facts (command, machine, load) and its rows; written
    whole or not at all (a suite that rewrites it after every point keeps its points if stopped mid-write)."""
    with open(path + ".tmp", "w") as f:
        json.dump({"facts": facts, "rows": [asdict(r) for r in rows]}, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def load_rows(path: str) -> Tuple[List[Row], Dict[str, Any]]:
    with open(path) as f:
        saved = json.load(f)
    rows = [Row(**dict(r, spread=tuple(r["spread"]) if r.get("spread") else None)) for r in saved["rows"]]
    return rows, saved["facts"]


__all__ = ["Row", "save_rows", "load_rows"]
