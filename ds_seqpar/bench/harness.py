"""The harness every suite of ``ds-seqpar bench`` runs on (one module per suite beside it, suites.py's
SUITES; each turns its measurements into report/rows.py's rows): the case vocabulary, timing,
interleaved rounds after a barrier, a fresh local rank pool, the machine and load facts, the options
every suite shares, and the page, rows and wandb runs each writes.

Rounds: ``warmup + repeats``, each running every case once after a barrier in a fixed order (A B C A
B C ...), so load from other processes hits all cases alike; a case's time in a round is its slowest
rank's wall time, and a ratio between two cases is taken per round, then the median.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shlex
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..strategies import RING_STRATEGIES

# -- the case vocabulary -----------------------------------------------------------------------------

SOFTMAX = ("ulysses",) + RING_STRATEGIES
ULYSSES_CHUNKED = ("ulysses_c1", "ulysses_c2", "ulysses_c4")      # cases of the vocabulary below
LINEAR = ("lasp2", "lasp1", "allscan")
# the case vocabulary every suite speaks: a case name -> its sequence_parallel keys (size and kernel per run);
# ds_ulysses is DeepSpeed's DistributedAttention on the group our Ulysses would use
SP_KEYS = {**{name: {"strategy": name} for name in SOFTMAX},
           "zigzag_no_overlap": {"strategy": "zigzag", "overlap": False},
           "hybrid": {"strategy": "zigzag", "ulysses_size": 2},             # Ulysses 2 x zigzag
           # Ulysses in head chunks, pipelined ("ulysses" itself is "auto": 1 chunk on CPU ranks)
           **{f"ulysses_c{c}": {"strategy": "ulysses", "ulysses_chunks": c} for c in (1, 2, 4)},
           "ulysses_auto": {"strategy": "ulysses", "ulysses_chunks": "auto"},
           "ds_ulysses": {"strategy": "ulysses"},
           "lasp2": {"strategy": "lasp", "lasp_comm": "allgather"}, "lasp1": {"strategy": "lasp", "lasp_comm": "ring"},
           "allscan": {"strategy": "lasp", "lasp_comm": "allscan"}}


def strategy_config(name: str, world: int, backend: str = "torch") -> dict:
    """The sequence_parallel section of a case of the vocabulary (SP_KEYS) on ``world`` ranks."""
    keys = dict(SP_KEYS[name])
    cfg = {"strategy": keys.pop("strategy"), "size": world, **keys}
    return cfg if cfg["strategy"] == "lasp" else dict(cfg, backend=backend)


def closed_form(name: str, p: int, shapes, **mask) -> List[int]:
    """Bytes per rank of one fwd+bwd of case ``name`` (strategies/closed_form.py, the oracle CommStats is
    held to); ``mask``: the cu_seqlens, causal and window closed_form_bytes takes."""
    from ..strategies.closed_form import closed_form_bytes
    cfg = strategy_config(name, p)
    return [closed_form_bytes(cfg["strategy"], p, shapes, rank, cfg.get("ulysses_size", 1),
                              cfg.get("lasp_comm", "allgather"), **mask) for rank in range(p)]


# -- timing ------------------------------------------------------------------------------------------


def attention_inputs(seq, heads, head_dim, kv_heads=None, batch=1, dtype=torch.float32, device="cpu", seed=0):
    """Global-order q, k, v, dout (the same on every rank: the seed is fixed)."""
    g = torch.Generator().manual_seed(seed)
    kv = kv_heads or heads
    shapes = [(batch, seq, heads, head_dim), (batch, seq, kv, head_dim), (batch, seq, kv, head_dim),
              (batch, seq, heads, head_dim)]
    return [torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in shapes]


def fwd_bwd(attend, q, k, v, dout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    attend(q, k, v).backward(dout)


def timed(fn, stats=None, device="cpu") -> dict:
    """Run ``fn`` once: wall and this thread's CPU seconds (on CUDA: wall for both); the stats are reset first."""
    if stats is not None:
        stats.reset()
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    if cuda:
        torch.cuda.synchronize()
    res = {"wall": time.perf_counter() - wall, "cpu": time.thread_time() - cpu}
    if cuda:
        res["cpu"] = res["wall"]        # GPU kernels are asynchronous: CPU time says nothing there
    if stats is not None:
        res.update(wait=stats.total_seconds, bytes=stats.total_bytes)
    return res


def saved_bytes(forward: Callable[[], Any]) -> int:
    """Bytes the autograd graph of ``forward()`` keeps for backward: every tensor saved through
    save_for_backward, counted once per storage (views and re-saves of one buffer share it)."""
    storages: Dict[Tuple[int, str], int] = {}

    def pack(t):
        s = t.untyped_storage()
        storages[(s.data_ptr(), str(t.device))] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out
    return sum(storages.values())


def alone(fns: Dict[str, Callable[[], Any]], rounds: int, key: str = "cpu", warmup: int = 0,
          device: str = "cpu") -> Dict[str, List[float]]:
    """One process, no barrier: ``warmup + rounds`` rounds of every function, each round starting at the
    next one (load and allocator state hit all alike); {name: seconds per kept round} (``key``: cpu or
    wall)."""
    names, out = list(fns), {name: [] for name in fns}
    for rnd in range(warmup + rounds):
        for name in names[rnd % len(names):] + names[:rnd % len(names)]:
            t = timed(fns[name], device=device)[key]
            if rnd >= warmup:
                out[name].append(t)
    return out


# -- rounds ------------------------------------------------------------------------------------------


def interleaved_rounds(fns, warmup: int, repeats: int, device: str = "cpu") -> Dict[str, list]:
    """{(case, variant): (run or None, stats or None)} -> {"case/variant": measured rounds}: warmup +
    repeats rounds, each running every case once after a barrier, in a fixed order (every suite's
    rounds). A round's entry: wall and CPU seconds, and with stats the bytes sent, by CommStats kind."""
    from .. import comm
    rounds = {f"{n}/{v}": [] for n, v in fns}
    for rnd in range(warmup + repeats):
        for (name, variant), (run, stats) in fns.items():
            comm.barrier()
            if run is None:
                continue
            res = timed(run, stats, device)
            if stats is not None:
                res["by_kind"] = {kd: b for kd, b in stats.bytes.items() if kd != "cu_seqlens_check"}
            if rnd >= warmup:
                rounds[f"{name}/{variant}"].append(res)
    comm.barrier()
    return rounds


def rank_rounds(args, case_fns, after=None) -> Dict[str, Any]:
    """What every rank of a suite runs: the interleaved rounds of ``case_fns(args, rank)``, then, with
    ``after`` = (key, fn), ``fn(args)`` under ``key`` on rank 0 alone (on_rank0)."""
    from .. import comm
    out = {"rounds": interleaved_rounds(case_fns(args, comm.global_rank()), args.warmup, args.repeats),
           "load_1min": os.getloadavg()[0]}
    if after:
        out[after[0]] = on_rank0(after[1], args)
    return out


def on_rank0(fn, *args):
    """``fn(*args)`` on rank 0 alone on its share of the machine, the other ranks waiting at a barrier
    (what a suite times after its rounds, without communication); None on the other ranks."""
    from .. import comm
    comm.barrier()
    out = fn(*args) if comm.global_rank() == 0 else None
    comm.barrier()
    return out


def case_times(per_rank, key) -> dict:
    """One case's rounds over the ranks that ran it: medians (min-max) of the slowest rank's wall time,
    per-rank CPU, per-round walls and busiest-rank CPU (for per-round ratios), bytes and wait per rank."""
    ranks = [r["rounds"][key] for r in per_rank if r["rounds"][key]]
    walls = [max(r[i]["wall"] for r in ranks) for i in range(len(ranks[0]))]
    cpu = [statistics.median(x["cpu"] for x in r) for r in ranks]
    cpu_rounds = [max(r[i]["cpu"] for r in ranks) for i in range(len(ranks[0]))]
    row = {"time": statistics.median(walls), "min": min(walls), "max": max(walls), "cpu": cpu,
           "imbalance": max(cpu) / (sum(cpu) / len(cpu)), "walls": walls, "cpu_rounds": cpu_rounds}
    if "by_kind" in ranks[0][0]:
        row["bytes"] = [sum(r[-1]["by_kind"].values()) for r in ranks]
        row["wait"] = [statistics.median(x["wait"] for x in r) for r in ranks]
    return row


def spread(xs: List[float]) -> Dict[str, float]:
    """Median, min and max: a value and how far its rounds went either way."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def median_ratio(a, b) -> float:
    return statistics.median(x / y for x, y in zip(a, b))


def ratio_range(a, b):
    ratios = [x / y for x, y in zip(a, b)]
    return min(ratios), max(ratios)


def versus(a: dict, b: dict) -> Dict[str, Any]:
    """Case times ``a`` against ``b`` (case_times): per round a / b (they ran back to back, under the same
    load), then the median: the wall time's ratio, its (min, max), and the busiest rank's CPU time's."""
    return {"ratio": median_ratio(a["walls"], b["walls"]), "ratio_range": ratio_range(a["walls"], b["walls"]),
            "cpu_ratio": median_ratio(a["cpu_rounds"], b["cpu_rounds"])}


# -- the run -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def fresh_pool(world: int, given=None, timeout_s: float = 3600.0):
    """``world`` fresh local CPU ranks (RankPool, one thread each, gloo), closed on the way out; or ``given``,
    an already started pool of that size (a test's session pool), left open."""
    from ..launch.rankpool import RankPool
    if given is not None:
        if given.world_size != world:
            raise ValueError(f"needs a pool of {world} ranks, got one of {given.world_size}")
        yield given
        return
    pool = RankPool(world, timeout_s=timeout_s, threads_per_rank=1).start()
    try:
        yield pool
    finally:
        pool.close()


def measure_on_pool(rank_fn, args, command: str, versions: bool = False):
    """``rank_fn(args)`` on P fresh local CPU ranks: (per-rank results, the page's meta: the options, CPUs,
    elapsed seconds, load before / after / at the end of the rounds, command; with ``versions`` also the
    CPU model, torch and DeepSpeed versions). Each rank's result carries its "load_1min" at the end of
    the rounds."""
    load_before, start = os.getloadavg(), time.monotonic()
    with fresh_pool(args.P) as pool:
        per_rank = pool.run(rank_fn, args, timeout=3600.0)
    meta = dict(vars(args), cpus=os.cpu_count(), elapsed=time.monotonic() - start,
                load_before=loads(load_before), load_after=loads(),
                load_during=max(r["load_1min"] for r in per_rank), command=command)
    if versions:
        meta.update({k: v for k, v in machine_facts().items() if k in ("cpu_model", "torch", "deepspeed")})
    return per_rank, meta


SIZE_HELP = {"P": "ranks (sequence-parallel size = world)", "seq": "global sequence length",
             "heads": "attention heads", "head_dim": "size of one head"}


def suite_parser(prog: str, doc: str, name: str, repeats: int = 5, **sizes: int) -> argparse.ArgumentParser:
    """A suite's parser with the options every suite shares: its sizes (P, seq, heads, head_dim: integer
    options with these defaults), the rounds and the page."""
    ap = argparse.ArgumentParser(prog=prog, description=" ".join(doc.split("\n\n")[0].split()))
    for key, default in sizes.items():
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, default=default, help=SIZE_HELP.get(key))
    ap.add_argument("--repeats", type=int, default=repeats, help="measured rounds")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first")
    ap.add_argument("--out", default="reports")
    ap.add_argument("--name", default=name)
    ap.add_argument("--notes", default="", help="free text added to the page")
    ap.add_argument("--render", metavar="ROWS", help="measure nothing: rewrite the page of a saved NAME.rows.json")
    return ap


def machine_facts() -> Dict[str, Any]:
    """CPU model, core count, Python, torch and DeepSpeed versions, and the load when asked."""
    import deepspeed
    import torch
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu_model": model, "cpus": os.cpu_count(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "python": platform.python_version(), "load_after": loads()}


def loads(values=None) -> str:
    """The 1, 5 and 15-minute load averages (now, or ``values``), as the pages quote them."""
    return " ".join(f"{x:.2f}" for x in (values or os.getloadavg()))


def command_line(prefix: str, argv: List[str]) -> str:
    """``prefix`` and the arguments, shell-quoted; --notes text is printed in the page, not here."""
    notes = {i for i, a in enumerate(argv) if a == "--notes"}
    shown = [a for i, a in enumerate(argv) if not ({i, i - 1} & notes or a.startswith("--notes="))]
    return " ".join([prefix] + [shlex.quote(a) for a in shown])


def machine_line(meta: Dict[str, Any]) -> str:
    """How a suite's run went: the machine and its load (meta from measure_on_pool plus machine_facts)."""
    known = [x for x in (meta.get("cpu_model"), f"{meta['cpus']} CPUs",
                         meta.get("torch") and f"torch {meta['torch']}") if x]
    return (f"{', '.join(known)}, shared with other jobs: load average before {meta['load_before']}, after "
            f"{meta['load_after']}, highest 1-minute value at the end of the rounds {meta['load_during']:.2f}; whole "
            f"run {meta['elapsed']:.0f} s.")


def attention_line(meta: Dict[str, Any]) -> str:
    """The shapes of a suite that times ``sp.attention`` on P CPU ranks, as its page states them."""
    return (f"P={meta['P']} ranks x 1 thread (gloo), N={meta['seq']} tokens, batch 1, {meta['heads']} heads x "
            f"{meta['head_dim']}, fp32, causal, forward + backward, kernel `torch` (CPU flash SDPA)")


def suite_facts(meta: Dict[str, Any], title: str, setup: str, metrics: Dict[str, str], rounds: bool = False
                ) -> Dict[str, Any]:
    """A suite's page facts (report/render.py): its title, setup and what each metric means, with the run's
    command, machine line and notes from ``meta`` (measure_on_pool's); with ``rounds`` the setup ends with how
    the interleaved rounds ran."""
    rounds = rounds and (f" {meta['repeats']} interleaved rounds after {meta['warmup']} warm-up round(s); a time is "
                         f"the median of the slowest rank's wall time; a ratio is taken per round (the cases run back "
                         f"to back, under the same load), then the median (min-max); CPU ratio: the same with the "
                         f"busiest rank's thread CPU time.")
    return {"title": title, "setup": setup + (rounds or ""), "command": meta["command"], "machine": machine_line(meta),
            "notes": meta.get("notes", ""), "metrics": metrics}


def write_page(out: str, name: str, rows, facts: Dict[str, Any], prog: str) -> int:
    """<out>/<name>.md and <out>/<name>.rows.json (the page and its rows: what --render and plan
    --calibrate read back); prints the targets' verdicts."""
    from ..report.render import checked, result, write
    held = [r for r in rows if r.target]
    width = max([len(f"{r.case} {r.variant}") for r in held] or [0])
    print("\n".join(f"{r.case + ' ' + r.variant:<{width}}  {r.metric[:40]:<40}  {max(checked(r)):8.3f}  {result(r)}"
                    for r in held))
    write(out, name, rows, facts, prog)
    return 0


def render_saved(path: str, prog: str):
    """--render: the page of a saved <name>.rows.json rewritten beside it from its rows and facts; (rows, facts)."""
    from ..report.rows import load_rows
    rows, facts = load_rows(path)
    write_page(os.path.dirname(path) or ".", os.path.basename(path)[:-len(".rows.json")], rows, facts, prog)
    return rows, facts


def log_rows(rows, meta: Dict[str, Any], run_dir: str, project: str) -> None:
    """--wandb: one run per case, grouped by the bench's name, every row's value (the largest rank's) by
    metric and variant, and the targets' verdicts; offline without credentials (``wandb sync`` uploads)."""
    import wandb
    from ..report.render import result
    from ..train.runlog import wandb_mode
    os.makedirs(run_dir, exist_ok=True)
    for case in dict.fromkeys(r.case for r in rows):
        mine = [r for r in rows if r.case == case and r.value is not None]
        run = wandb.init(project=project, group=meta["name"], name=f"{meta['name']}/{case}", job_type="bench",
                         dir=os.path.abspath(run_dir), mode=wandb_mode(), config=dict(meta, case=case))
        run.summary.update({f"{r.metric}/{r.variant}": max(r.values()) for r in mine})
        run.summary["checks"] = [{"metric": r.metric, "variant": r.variant, "result": result(r)} for r in mine
                                 if r.target]
        run.finish()


def suite_main(argv: Optional[List[str]], parser: argparse.ArgumentParser, measure, plots=None) -> int:
    """A suite's command line: with --render ROWS the saved page is rewritten from its rows (render_saved), and
    its figures with ``plots(rows, meta, folder)``; otherwise ``measure(args, argv)``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if not args.render:
        return measure(args, argv)
    rows, facts = render_saved(args.render, parser.prog)
    if plots:
        plots(rows, facts["meta"], os.path.join(os.path.dirname(args.render) or ".", facts["meta"]["name"]))
    return 0
