"""Compiled vs eager training step of the main job at P=2 (zigzag, ZeRO-2) on CPU gloo ranks: the own LM and
a tiny Llama-architecture model (--model, a local config). Eager and compiled runs alternate (repeats),
each a fresh job of STEPS steps on a 2-rank pool; the ratio uses the busiest rank's median step time after
the first step (the first step holds the compile), compile time = first step - that median.

    PYTHONPATH=. python reports/compile_cpu.py [--backend inductor] [--steps 6] [--repeats 2] [--out reports/compile_cpu.md]

``--attention``: instead, the attention alone per strategy (sp.attention; lasp: sp.linear_attention), fwd+bwd
at P=2, eager and compiled with fullgraph under aot_eager and inductor, in the bench harness's interleaved
rounds (each round runs every case once after a barrier). The page keeps both parts: each run rewrites its own
(the training table first, the "Attention alone" section last) and leaves the other as it was.

    PYTHONPATH=. python reports/compile_cpu.py --attention [--seq 1024] [--repeats 10] [--out reports/compile_cpu.md]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TINY = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "seq_len": 256, "ignore_frac": 0.0,
        "corpus_bytes": 1 << 18, "quiet": True, "no_wandb": True, "sp_size": 2,
        "deepspeed_config": os.path.join(ROOT, "configs", "zigzag_zero2.json")}


def one_run(args):
    import torch
    from torch._dynamo.utils import counters
    from ds_seqpar.train import run_training
    torch._dynamo.reset()
    counters.clear()
    cpu0 = time.process_time()
    result = run_training(args)
    steps = [m["step_s"] for m in result["memory"]]
    return {"losses": result["losses"], "first_s": steps[0], "median_s": statistics.median(steps[1:]),
            "cpu_s": time.process_time() - cpu0, "breaks": sum(counters["graph_break"].values()),
            "graphs": counters["stats"]["unique_graphs"]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="inductor")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--attention", action="store_true", help="the attention alone per strategy (module doc)")
    p.add_argument("--seq", type=int, default=1024, help="--attention: global tokens")
    p.add_argument("--out", default=os.path.join(ROOT, "reports", "compile_cpu.md"))
    o = p.parse_args()
    load = os.getloadavg()[0]
    from ds_seqpar.launch.rankpool import RankPool
    if o.attention:
        return attention_main(o, load)
    from tests.hf_models import save_tiny
    pool = RankPool(2, timeout_s=1800).start()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        llama = save_tiny(os.path.join(tmp, "llama"), "llama", num_hidden_layers=2, max_position_embeddings=512,
                          vocab_size=256)
        for name, extra in (("own LM", {}), ("tiny Llama (HF)", {"model": llama})):
            runs = {None: [], o.backend: []}
            for _ in range(o.repeats):
                for mode in (None, o.backend):          # interleaved
                    args = dict(TINY, steps=o.steps, run_dir=os.path.join(tmp, "runs"), compile=mode, **extra)
                    runs[mode].append(pool.run(one_run, args, timeout=1800))
            rows.append((name, runs))
    pool.close()
    write_parts(o.out, render(rows, o, (load, os.getloadavg()[0])), None)


def write_parts(path, training, attention):
    """The page: the training part, then the attention section; None keeps what the page holds now."""
    page = open(path).read() if os.path.exists(path) else ""
    before, _, after = page.partition(SECTION)
    training = before.rstrip() if training is None else training
    attention = (SECTION + after).rstrip() if attention is None and after else attention
    with open(path, "w") as f:
        f.write(training.rstrip() + "\n" + ("\n" + attention + "\n" if attention else ""))


def busiest(run, key):
    return max(rank[key] for rank in run)


def render(rows, o, load):
    out = [f"# torch.compile vs eager training step, CPU, P=2 zigzag ZeRO-2 (backend {o.backend})", "",
           f"Command: `PYTHONPATH=. python reports/compile_cpu.py --backend {o.backend} --steps {o.steps} "
           f"--repeats {o.repeats}` (2 gloo ranks, one thread each; eager and compiled runs interleaved).", "",
           f"The machine is shared and loaded: 1-minute load average {load[0]:.1f} at the start and {load[1]:.1f} at "
           f"the end, on 2 cores; compare the columns of one row only. Step times: the busiest rank's median over "
           f"steps 2..{o.steps} (wall clock), median over the repeats; compile s: the compiled run's first step minus "
           f"that median. CPU s: the busiest rank's process CPU time over the whole job (inductor compiles in "
           f"worker processes, not counted). Graph breaks and graphs compiled: torch._dynamo's counters on the "
           f"busiest rank; losses equal: every step within 1e-5 relative.", "",
           "| model | eager step s | compiled step s | compiled / eager | compile s | busiest rank CPU s (eager / compiled run) "
           "| graph breaks | graphs compiled | losses equal |", "|---|---|---|---|---|---|---|---|---|"]
    for name, runs in rows:
        eager, comp = runs[None], runs[o.backend]
        e = statistics.median(busiest(r, "median_s") for r in eager)
        c = statistics.median(busiest(r, "median_s") for r in comp)
        compile_s = statistics.median(busiest(r, "first_s") for r in comp) - c
        cpu = (statistics.median(busiest(r, "cpu_s") for r in eager), statistics.median(busiest(r, "cpu_s") for r in comp))
        same = all(max(abs(a - b) / abs(b) for a, b in zip(rc["losses"], re["losses"])) <= 1e-5
                   for rc_run, re_run in zip(comp, eager) for rc, re in zip(rc_run, re_run))
        out.append(f"| {name} | {e:.4f} | {c:.4f} | {c / e:.2f} | {compile_s:.1f} | {cpu[0]:.1f} / {cpu[1]:.1f} "
                   f"| {max(busiest(r, 'breaks') for r in comp)} | {max(busiest(r, 'graphs') for r in comp)} | {same} |")
    out += ["", NOTES]
    return "\n".join(out)


NOTES = """Recompiles over 100 steps of packed data (a new global length of 32/48/64 tokens and a new packing of
1-4 documents every step; applied tiny Llama, zigzag P=2): 4 graphs per rank, then none
(tests/dist/test_compile_hf.py::test_new_lengths_and_packings_do_not_recompile_every_step bounds it at 4).

Graph breaks under torch._dynamo.explain (tests/dist/test_compile_hf.py): applied tiny Llama 0, plain 0
(17 before the integration's checks, the loss's reduction and the attention became opaque ops).
Hybrids: an applied tiny Qwen3.5 (gated DeltaNet) and Bamba (Mamba2) compile with fullgraph=True, 0 graph
breaks as their plain models, and train one step as eager at P=2 and 4 under aot_eager
(tests/dist/test_compile_hybrids.py); their step time compiled vs eager is not measured here.
"""


# -- the attention alone -----------------------------------------------------------------------------------

ATTENTION = ("ulysses", "ring", "zigzag", "striped", "hybrid", "lasp")
MODES = ("eager", "aot_eager", "inductor")
SECTION = "## Attention alone per strategy, compiled vs eager"


def attention_rank(o):
    """Every rank: per strategy one fwd+bwd eager, then under each backend (fullgraph); its first call (the
    compile) timed alone; the outputs and input gradients against eager's; then the interleaved rounds."""
    import torch
    from ds_seqpar.bench.harness import attention_inputs, fwd_bwd, interleaved_rounds, strategy_config, timed
    from ds_seqpar.sequence_parallel import SequenceParallel
    q, k, v, dout = attention_inputs(o.seq, 4, 32)
    torch._dynamo.config.recompile_limit = 64        # one code object (the lambda) x 6 strategies x 2 backends
    fns, first, diff = {}, {}, {}
    for name in ATTENTION:
        sp = SequenceParallel(strategy_config("lasp2" if name == "lasp" else name, 2))
        x = [sp.shard(t).clone() for t in (q, k, v, dout)]
        call = (lambda a, b, c, sp=sp: sp.linear_attention(a, b, c)) if name == "lasp" else \
            (lambda a, b, c, sp=sp: sp.attention(a, b, c, causal=True))
        want = None
        for mode in MODES:
            f = call if mode == "eager" else torch.compile(call, backend=mode, fullgraph=True, dynamic=False)
            leaves = [t.detach().requires_grad_() for t in x[:3]]
            first[name, mode] = timed(lambda: f(*leaves).backward(x[3]))["wall"]
            got = [f(*leaves)] + [t.grad for t in leaves]
            want = want or got
            diff[name, mode] = max(float((a - b).detach().abs().max()) for a, b in zip(got, want))
            fns[name, mode] = (lambda f=f, x=x: fwd_bwd(f, *x), None)
    return {"rounds": interleaved_rounds(fns, o.warmup, o.repeats), "first": first, "diff": diff,
            "load_1min": os.getloadavg()[0]}


def attention_main(o, load):
    from ds_seqpar.bench.harness import case_times, versus
    from ds_seqpar.launch.rankpool import RankPool
    o.warmup = 1
    pool = RankPool(2, timeout_s=1800, threads_per_rank=1).start()
    try:
        per_rank = pool.run(attention_rank, o, timeout=1800)
    finally:
        pool.close()
    cmd = f"PYTHONPATH=. python reports/compile_cpu.py --attention --seq {o.seq} --repeats {o.repeats}"
    out = [SECTION, "", f"Command: `{cmd}` (2 gloo ranks, one thread each).", "",
           f"sp.attention(q, k, v, causal=True) (lasp: sp.linear_attention, LASP-2), forward + backward, N={o.seq} "
           f"tokens, batch 1, 4 heads x 32, fp32, P=2 (hybrid: ulysses_size 2 x a ring of 1 at this P). Compiled: "
           f"torch.compile(fullgraph=True, dynamic=False), backends aot_eager and inductor (dynamic=False: one "
           f"lambda serves every strategy; its int arguments stay constants). {o.repeats} rounds after one warm-up, "
           f"each running every case once after a barrier (bench/harness.py interleaved_rounds); time: the slowest "
           f"rank's wall, median (min-max) over rounds; ratio: per round, then the median. First call: the compiled "
           f"call's first fwd+bwd (dynamo, AOT autograd, codegen), the slower rank. Largest difference: outputs and "
           f"q/k/v gradients against eager, the larger rank. CPU numbers on a shared 2-core machine: 1-minute load "
           f"average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end. The op is one opaque node for the "
           f"compiler (docs/compile.md): compiled and eager run the same body, so the difference must be 0 and the "
           f"time ratio near 1; a ratio far from 1 here, with its wide min-max, is the machine's load.", "",
           "| strategy | eager ms | aot_eager ms | aot_eager / eager | inductor ms | inductor / eager | first call s "
           "(aot_eager / inductor) | largest difference (aot_eager / inductor) |", "|---|---|---|---|---|---|---|---|"]
    for name in ATTENTION:
        t = {m: case_times(per_rank, f"{name}/{m}") for m in MODES}
        cells = [f"{t['eager']['time'] * 1e3:.2f}"]
        for m in MODES[1:]:
            vs = versus(t[m], t["eager"])
            cells += [f"{t[m]['time'] * 1e3:.2f}", f"{vs['ratio']:.2f} ({vs['ratio_range'][0]:.2f}-"
                      f"{vs['ratio_range'][1]:.2f})"]
        firsts = " / ".join(f"{max(r['first'][name, m] for r in per_rank):.1f}" for m in MODES[1:])
        diffs = " / ".join(f"{max(r['diff'][name, m] for r in per_rank):.1e}" for m in MODES[1:])
        out.append(f"| {name} | {' | '.join(cells)} | {firsts} | {diffs} |")
    write_parts(o.out, None, "\n".join(out))


if __name__ == "__main__":
    main()
