"""Ring-family preset of ``ds-seqpar bench`` (the measurement code lives in bench_cases.py): causal
fwd+bwd attention, single process vs ring, zigzag, striped, Ulysses and zigzag without overlap, side
by side in one run, with the command line reports/ring_cpu.md was made with.

    python -m ds_seqpar.bench_ring [--world 2] [--seq 8192] [--heads 8] [--head-dim 64]
                                   [--repeats 5] [--warmup 1] [--out reports/ring_cpu.md] [--notes TEXT]

is ``ds-seqpar bench --strategies ring,zigzag,striped,ulysses,zigzag_no_overlap --train-strategies none
--mem-budget-n 0`` with these sizes; the page is written to --out, its JSON and plots beside it.
"""
from __future__ import annotations

import argparse
import os
from typing import List, Optional

# bench_lasp imports its timing helpers from here; they are bench_cases' (one framework)
from .cases import _fwd_bwd, _inputs, _timed  # noqa: F401

STRATEGIES = "ring,zigzag,striped,ulysses,zigzag_no_overlap"


def bench_argv(argv: Optional[List[str]] = None) -> List[str]:
    """The ``ds-seqpar bench`` arguments this preset stands for."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default="reports/ring_cpu.md")
    ap.add_argument("--notes", default="")
    a = ap.parse_args(argv)
    name = os.path.splitext(os.path.basename(a.out))[0]
    return ["--preset", "full", "--strategies", STRATEGIES, "--P", str(a.world), "--seq-lens", str(a.seq),
            "--heads", str(a.heads), "--head-dim", str(a.head_dim), "--repeats", str(a.repeats),
            "--warmup", str(a.warmup), "--train-strategies", "none", "--mem-budget-n", "0",
            "--out", os.path.dirname(a.out) or ".", "--name", name] + (["--notes", a.notes] if a.notes else [])


def main(argv: Optional[List[str]] = None) -> int:
    from .main import main as bench_main
    return bench_main(bench_argv(argv))


if __name__ == "__main__":
    raise SystemExit(main())
