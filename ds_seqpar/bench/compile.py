"""``ds-seqpar bench compile``: torch.compile against eager on 2 local CPU ranks (gloo, one thread each), in two
parts, each a table of the page (docs/compile.md):

  step       (the default) the main job's training step at P=2 (zigzag, ZeRO-2) through train.run_training: the
             own LM and a tiny Llama-architecture model (a local model directory, --model). Eager and compiled runs
             alternate (``--repeats`` pairs), each a fresh job of ``--steps`` steps on one 2-rank pool; the ratio
             uses the busiest rank's median step time after the first step (the first step holds the compile),
             compile time = the compiled run's first step - that median.
  attention  (``--attention``) the attention alone per strategy (sp.attention; lasp: sp.linear_attention), fwd+bwd
             at P=2, eager and compiled with fullgraph under aot_eager and inductor, in the harness's interleaved
             rounds (each round runs every case once after a barrier).

A run rewrites its own part's rows in <out>/<name>.rows.json and keeps the other part's (with their command
and load), so the page holds both. reports/compile_cpu.md came from ``ds-seqpar bench compile --steps 12
--repeats 3`` and ``ds-seqpar bench compile --attention --seq 1024 --repeats 20``.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any, Dict, List, Optional

from ..report.rows import Row, load_rows
from .harness import (case_times, command_line, machine_facts, machine_line, measure_on_pool, suite_main,
                      suite_parser, versus, write_page)

PROG = "ds-seqpar bench compile"
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
STEP, ATTENTION = "Training step, compiled / eager", "Attention alone per strategy, compiled / eager"
PARTS = {"step": STEP, "attention": ATTENTION}              # part -> the metric (table) its rows fill
TINY = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "seq_len": 256, "ignore_frac": 0.0,
        "corpus_bytes": 1 << 18, "quiet": True, "no_wandb": True, "sp_size": 2,
        "deepspeed_config": os.path.join(ROOT, "configs", "zigzag_zero2.json")}
LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=256, max_position_embeddings=512, attention_dropout=0.0, use_cache=False)
STRATEGIES = ("ulysses", "ring", "zigzag", "striped", "hybrid", "lasp")
MODES = ("eager", "aot_eager", "inductor")
NOTES = ("Recompiles over 100 steps of packed data (a new global length of 32/48/64 tokens and a new packing of 1-4 "
         "documents every step; applied tiny Llama, zigzag P=2): 4 graphs per rank, then none "
         "(tests/dist/test_compile_hf.py::test_new_lengths_and_packings_do_not_recompile_every_step bounds 40 such "
         "steps at 4). Graph breaks under torch._dynamo.explain (tests/dist/test_compile_hf.py): applied tiny Llama 0, "
         "plain 0 (17 before the integration's checks, the loss's reduction and the attention became opaque ops). "
         "Hybrids: an applied tiny Qwen3.5 (gated DeltaNet) and Bamba (Mamba2) compile with fullgraph=True, 0 graph "
         "breaks as their plain models, and train one step as eager at P=2 and 4 under aot_eager "
         "(tests/dist/test_compile_hybrids.py); their step time compiled vs eager is not measured here.")


# -- the training step -------------------------------------------------------------------------------------


def save_tiny_llama(path: str) -> str:
    """A local model directory (config and seed-0 weights) of the tiny Llama the step part trains."""
    import torch
    import transformers as T
    torch.manual_seed(0)
    T.AutoModelForCausalLM.from_config(T.LlamaConfig(**LLAMA), attn_implementation="sdpa").save_pretrained(path)
    return path


def _one_run(opts: Dict[str, Any]) -> Dict[str, Any]:
    """This rank's view of one training job: losses, first and median later step, CPU, dynamo's counters."""
    import torch
    from torch._dynamo.utils import counters

    from ..train.main import run_training
    torch._dynamo.reset()
    counters.clear()
    cpu0 = time.process_time()
    result = run_training(opts)
    steps = [m["step_s"] for m in result["memory"]]
    return {"losses": result["losses"], "first_s": steps[0], "median_s": statistics.median(steps[1:]),
            "cpu_s": time.process_time() - cpu0, "breaks": sum(counters["graph_break"].values()),
            "graphs": counters["stats"]["unique_graphs"]}


def _step_rank(args) -> Dict[str, Any]:
    """Every rank: per model, ``repeats`` pairs of runs (eager, then compiled: interleaved)."""
    runs: Dict[str, Dict[str, List[dict]]] = {}
    for name, extra in (("own LM", {}), ("tiny Llama (HF)", {"model": args.llama_dir})):
        runs[name] = {"eager": [], args.backend: []}
        for _ in range(args.repeats):
            for mode in ("eager", args.backend):
                opts = dict(TINY, steps=args.steps, run_dir=os.path.join(args.tmp, "runs"),
                            compile=None if mode == "eager" else mode, **extra)
                runs[name][mode].append(_one_run(opts))
    return {"runs": runs, "load_1min": os.getloadavg()[0]}


def _busiest(per_rank, name: str, mode: str, key: str) -> List[float]:
    """Per repeat, the largest value of ``key`` over the ranks."""
    return [max(r["runs"][name][mode][i][key] for r in per_rank) for i in range(len(per_rank[0]["runs"][name][mode]))]


def step_rows(per_rank, args) -> List[Row]:
    rows = []
    for name in per_rank[0]["runs"]:
        med = lambda mode, key: statistics.median(_busiest(per_rank, name, mode, key))  # noqa: E731
        e, c = med("eager", "median_s"), med(args.backend, "median_s")
        same = all(max(abs(a - b) / abs(b) for a, b in zip(rc["losses"], re["losses"])) <= 1e-5
                   for r in per_rank for rc, re in zip(r["runs"][name][args.backend], r["runs"][name]["eager"]))
        rows.append(Row("compile", name, f"{args.backend}, P=2 zigzag ZeRO-2", STEP, "x", c / e, detail={
            "eager step s": e, "compiled step s": c, "compile s": med(args.backend, "first_s") - c,
            "busiest rank CPU s (eager / compiled run)": [med("eager", "cpu_s"), med(args.backend, "cpu_s")],
            "graph breaks": max(_busiest(per_rank, name, args.backend, "breaks")),
            "graphs compiled": max(_busiest(per_rank, name, args.backend, "graphs")), "losses equal": same}))
    return rows


def step_text(meta) -> str:
    return (f"Command: `{meta['command']}`. The main job at P=2 (2 gloo ranks, one thread each), zigzag, ZeRO-2, "
            f"sequence {TINY['seq_len']}; own LM dim {TINY['dim']} x {TINY['n_layers']} layers, tiny Llama hidden "
            f"{LLAMA['hidden_size']} x {LLAMA['num_hidden_layers']} layers (a local model directory); backend "
            f"{meta['backend']}, {meta['repeats']} eager / compiled pairs of fresh {meta['steps']}-step jobs, "
            f"interleaved. Value: compiled / eager step time, each the busiest rank's median over steps "
            f"2..{meta['steps']} (wall clock), median over the repeats; compile s: the compiled run's first step "
            f"minus that median. CPU s: the busiest rank's process CPU time over the whole job (inductor compiles in "
            f"worker processes, not counted). Graph breaks and graphs compiled: torch._dynamo's counters on the "
            f"busiest rank; losses equal: every step within 1e-5 relative. {machine_line(meta)}")


# -- the attention alone -----------------------------------------------------------------------------------


def _attention_rank(args) -> Dict[str, Any]:
    """Every rank: per strategy one fwd+bwd eager, then under each backend (fullgraph); its first call (the
    compile) timed alone; the outputs and input gradients against eager's; then the interleaved rounds."""
    import torch

    from ..sequence_parallel import SequenceParallel
    from .harness import attention_inputs, fwd_bwd, interleaved_rounds, strategy_config, timed
    q, k, v, dout = attention_inputs(args.seq, 4, 32)
    torch._dynamo.config.recompile_limit = 64        # one code object (the lambda) x 6 strategies x 2 backends
    fns, first, diff = {}, {}, {}
    for name in STRATEGIES:
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
    return {"rounds": interleaved_rounds(fns, args.warmup, args.repeats), "first": first, "diff": diff,
            "load_1min": os.getloadavg()[0]}


def attention_rows(per_rank) -> List[Row]:
    rows = []
    for name in STRATEGIES:
        eager = case_times(per_rank, f"{name}/eager")
        for mode in MODES[1:]:
            t = case_times(per_rank, f"{name}/{mode}")
            vs = versus(t, eager)
            rows.append(Row("compile", name, mode, ATTENTION, "x", vs["ratio"], tuple(vs["ratio_range"]), detail={
                "eager ms": eager["time"] * 1e3, "compiled ms": t["time"] * 1e3,
                "first call s": max(r["first"][name, mode] for r in per_rank),
                "largest difference": max(r["diff"][name, mode] for r in per_rank)}))
    return rows


def attention_text(meta) -> str:
    return (f"Command: `{meta['command']}`. sp.attention(q, k, v, causal=True) (lasp: sp.linear_attention, LASP-2), "
            f"forward + backward, N={meta['seq']} tokens, batch 1, 4 heads x 32, fp32, P=2 (2 gloo ranks, one "
            f"thread each; hybrid: ulysses_size 2 x a ring of 1 at this P). Compiled: torch.compile(fullgraph=True, "
            f"dynamic=False) under the variant's backend (dynamic=False: one lambda serves every strategy; its int "
            f"arguments stay constants). {meta['repeats']} round(s) after {meta['warmup']} warm-up, each running every "
            f"case once after a barrier; value: compiled / eager time per round, median (min-max); a time: the "
            f"slowest rank's wall, median over rounds. First call: the compiled call's first fwd+bwd (dynamo, AOT "
            f"autograd, codegen), the slower rank. Largest difference: outputs and q/k/v gradients against eager, the "
            f"larger rank. The op is one opaque node for the compiler (docs/compile.md): compiled and eager run the "
            f"same body, so the difference must be 0 and the ratio near 1; a ratio far from 1, with a wide min-max, "
            f"is the machine's load. {machine_line(meta)}")


# -- the page ----------------------------------------------------------------------------------------------


def page(out: str, name: str, part: str, rows: List[Row], text: str, meta: Dict[str, Any]):
    """(rows, facts) of the page: this run's part, the other part's rows and text kept from the saved rows."""
    path = os.path.join(out, f"{name}.rows.json")
    kept, parts = [], {}
    if os.path.exists(path):
        saved, facts = load_rows(path)
        kept = [r for r in saved if r.metric != PARTS[part]]
        parts = {p: v for p, v in facts.get("parts", {}).items() if p != part}
    parts[part] = {"text": text, "meta": meta}
    rows = sorted(kept + rows, key=lambda r: list(PARTS.values()).index(r.metric))    # the step's table first
    facts = {"title": "torch.compile vs eager on CPU ranks, P=2: the main job's training step and the attention alone",
             "setup": "Two parts, each its own run and table (its command, shapes and load in the table's text); "
                      "compare the columns of one row only on this shared machine.",
             "notes": " ".join(x for x in (NOTES, meta.get("notes", "")) if x),
             "metrics": {PARTS[p]: parts[p]["text"] for p in PARTS if p in parts}, "parts": parts, "meta": meta}
    return rows, facts


def measure(args, argv: List[str]) -> int:
    part = "attention" if args.attention else "step"
    args.P, args.repeats = 2, args.repeats or (10 if args.attention else 2)
    if args.steps < 2 or args.repeats < 1 or args.seq % 4:
        raise SystemExit(f"{PROG}: --steps {args.steps} must be >= 2 (the first holds the compile), --repeats "
                         f"{args.repeats} >= 1, --seq {args.seq} a multiple of 4 (zigzag at P=2)")
    with tempfile.TemporaryDirectory() as tmp:
        if part == "step":
            args.tmp, args.llama_dir = tmp, save_tiny_llama(os.path.join(tmp, "llama"))
        per_rank, meta = measure_on_pool(_attention_rank if args.attention else _step_rank, args,
                                         command_line(PROG, argv))
    meta.update(machine_facts())
    meta = {k: v for k, v in meta.items() if k not in ("tmp", "llama_dir")}
    if part == "step":
        rows, text = step_rows(per_rank, args), step_text(meta)
    else:
        rows, text = attention_rows(per_rank), attention_text(meta)
    return write_page(args.out, args.name, *page(args.out, args.name, part, rows, text, meta), PROG)


def parser():
    ap = suite_parser(PROG, __doc__, "compile_cpu", repeats=0, seq=1024)
    ap.set_defaults(repeats=None)           # the part's: 2 pairs of jobs (step), 10 rounds (attention)
    ap.add_argument("--attention", action="store_true", help="the attention alone per strategy (else the step)")
    ap.add_argument("--backend", default="inductor", help="the step part's torch.compile backend")
    ap.add_argument("--steps", type=int, default=6, help="the step part: steps per job (the first holds the compile)")
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    return suite_main(argv, parser(), measure)


__all__ = ["main", "save_tiny_llama"]
