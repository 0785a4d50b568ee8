"""Step time and the bytes that cross hosts: the main job on two network-namespace hosts x 2 ranks vs
one host x 4 ranks, for zigzag and the 2D hybrid (Ulysses 2 inside a host, a ring of 2 across).

It lives beside the multi-node tests because it stands on their hosts and jobs (netns.py, jobs.py): root, network
namespaces, torchrun inside them, nothing the package ships. Run as root on a machine where `ip netns` works,
from the repository root:

    python -m tests.multinode.measure --rounds 2 > reports/multinode_cpu.md

Bytes on the link are the hosts' interface counters (tx of both hosts), sampled while the job runs,
between the end of step FIRST and the end of the last step, per step. They are set against:
- attention: the closed form per rank (strategies/closed_form.py, by kind) times the ranks whose
  sends cross for this placement (zigzag's ring 0-1-2-3-0 crosses on 1->2 and 3->0: 2 of 4 ranks;
  the hybrid's rings {0, 2}, {1, 3} cross on every send, its all-to-alls stay inside a host), times the
  layers; `sp.stats` gives the measured per-rank attention bytes (metrics.jsonl attn_comm_bytes);
- gradients: a ring all-reduce of the fp32 gradients over the 4 ranks, 2 (P - 1) / P x bytes per
  link, 2 of the 4 links crossing;
- the rest (headers, ZeRO's and the loss's small collectives, the metrics reductions) is what the
  link carried beyond both.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from ds_seqpar.strategies.closed_form import Shapes, closed_form_by_kind
from . import jobs, netns

MODEL = ["--seq_len", "2048", "--dim", "128", "--n_layers", "2", "--n_heads", "4", "--corpus_bytes", "1048576",
         "--no_progress", "--no_wandb", "--micro_batch", "1"]
CASES = {"zigzag": dict(strategy="zigzag", size=4), "hybrid u2 x r2": dict(strategy="zigzag", size=4, ulysses_size=2)}
STEPS, FIRST = 10, 3


def tx_bytes(hosts) -> int:
    return sum(int(subprocess.run(["ip", "netns", "exec", h, "cat", f"/sys/class/net/{netns.IFNAME}/statistics/tx_bytes"],
                                  capture_output=True, text=True, check=True).stdout) for h in hosts.names)


def run(hosts, tmp, case, two_hosts, port):
    runs = tempfile.mkdtemp(dir=tmp)
    cfg = ["--deepspeed_config", jobs.ds_config(tmp, **CASES[case]), "--steps", str(STEPS), *MODEL, "--run_dir", runs]
    cmds = ([jobs.torchrun_on(hosts, node, port, cfg) for node in (0, 1)] if two_hosts
            else [jobs.torchrun_on(hosts, 0, port, cfg, nnodes=1, nproc=4)])
    marks, done = {}, threading.Event()

    def sample():               # the link's counter at the first sight of each step count
        while not done.is_set():
            n = jobs.steps_logged(runs)
            marks.setdefault(n, tx_bytes(hosts))
            time.sleep(0.05)
    threading.Thread(target=sample, daemon=True).start()
    job = jobs.Job(cmds, hosts.env())
    try:
        assert all(c == 0 for c in job.wait(600)), job.output[-3000:]
    finally:
        done.set()
        job.close()
    records = jobs.records(os.path.join(runs, os.listdir(runs)[0]))
    step_s = statistics.median(r["step_s"] for r in records[FIRST:])
    link = (marks[STEPS] - marks[FIRST]) / (STEPS - FIRST) if STEPS in marks and FIRST in marks else float("nan")
    info = jobs.run_info(runs)
    return step_s, link, records[-1]["attn_comm_bytes"], info


def predicted(case, info):
    sp = CASES[case]
    shapes = Shapes(batch=info["micro_batch"], seq=info["seq_len"], heads=4, kv_heads=4, head_dim=32)
    kinds = closed_form_by_kind(sp["strategy"], sp["size"], shapes, ulysses_size=sp.get("ulysses_size", 1))
    ring = kinds.get("ring", 0) + kinds.get("ring_grad", 0)
    crossing_ranks = 4 if sp.get("ulysses_size", 1) > 1 else 2
    layers = info["model"].get("n_layers", 2)
    grads = 2 * 2 * (4 - 1) / 4 * info["num_params"] * 4
    return sum(kinds.values()) * layers, ring * crossing_ranks * layers, grads


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    if netns.unavailable():
        sys.exit(f"no network namespaces here: {netns.unavailable()}")
    hosts, tmp = netns.Hosts(2).up(), tempfile.mkdtemp()
    results = {}
    load = [os.getloadavg()[0]]
    try:
        port = 29700
        for _ in range(args.rounds):                  # interleaved: every case and placement per round
            for case in CASES:
                for two in (True, False):
                    port += 1
                    results.setdefault((case, two), []).append(run(hosts, tmp, case, two, port))
        load.append(os.getloadavg()[0])
    finally:
        netns.cleanup()
    print("# The main job across two hosts vs one host (CPU ranks, network namespaces)\n")
    print(f"Command: `python -m tests.multinode.measure --rounds {args.rounds}`; own LM, "
          f"{' '.join(MODEL[:8])}, fp32, ZeRO-2, {STEPS} steps, medians of steps {FIRST + 1}-{STEPS}; "
          f"2 hosts x 2 ranks (torchrun on each host) vs 1 host x 4 ranks (torchrun); load average "
          f"{load[0]:.1f} at the start, {load[-1]:.1f} at the end, on 2 cores shared by the 4 ranks.\n")
    print("| case | step s, 2 hosts | step s, 1 host | ratio | attention B/step/rank: sp.stats | closed form "
          "| crossing hosts B/step: measured link | attention (closed form) | gradients (ring model) | rest |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for case in CASES:
        two, one = results[(case, True)], results[(case, False)]
        s2, s1 = statistics.median(r[0] for r in two), statistics.median(r[0] for r in one)
        link = statistics.median(r[1] for r in two)
        per_rank, crossing, grads = predicted(case, two[0][3])
        print(f"| {case} | {s2:.3f} | {s1:.3f} | {s2 / s1:.2f} | {two[0][2]:,} | {per_rank:,} | {link:,.0f} | "
              f"{crossing:,} | {grads:,.0f} | {link - crossing - grads:,.0f} |")
    one_link = statistics.median(r[1] for case in CASES for r in results[(case, False)])
    print(f"\nOne host: {one_link:,.0f} B per step on the hosts' interface (its ranks talk over loopback).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
