"""The trainer suite's results (bench/trainer.py) as rows: each case's exactness against plain data
parallelism and its step time, the per-step trajectories, what DeepSpeed's path raises on gloo, and the
Trainer's overhead over this project's own loop; with the facts a reader needs around them."""
from __future__ import annotations

import statistics
from typing import Any, Dict, List

from ..report.rows import Row
from .harness import machine_line

CASES = "Side by side: plain data parallelism, ds_seqpar, DeepSpeed's Ulysses (ALST)"
STEPS = "Per step (round 0): plain's loss, and how far the others are"
GLOO = "What DeepSpeed's path raises on CPU (gloo), per rank of 4 in groups of 2"
OVERHEAD = "Trainer overhead: SequenceParallelTrainer vs this project's own loop (Trainer / own)"
GLOO_WHAT = {"variable widths": "ALST's loader adapter all-gathers each rank's batch at its own width (ulysses_sp.py, "
                                "`UlyssesSPDataLoaderAdapter.refill`); gloo requires equal sizes",
             "loss backward": "the ALST loss all-gathers per-rank losses with torch's differentiable `all_gather`, "
                              "whose backward on gloo scatters with the group-local index as a global source rank"}


def _case(name: str, r: Dict[str, Any], meta: Dict[str, Any]) -> Row:
    """A case's row: its layout, step time / plain and exactness against plain; or where it failed."""
    c = meta["cases"][name]
    sp = c["sequence_parallel"] or {"size": 2}                     # None: ALST, in groups of 2
    extra = f", ulysses_size {sp['ulysses_size']}" if sp.get("ulysses_size", 1) > 1 else ""
    layout = f"dp{meta['world'] // sp['size']} x sp{sp['size']}{extra}, micro {c['micro']}"
    detail = {"trainer": "SequenceParallelTrainer" if c["sequence_parallel"] else
              "transformers' Trainer + ParallelismConfig(sp_backend='deepspeed')"}
    if "error" in r:
        return Row("trainer", name, layout, CASES, detail=dict(
            detail, failed=f"round {r['round']}, rank {r['rank']}: {r['error']} ({r['at']})"))
    v = r["vs_plain"]
    return Row("trainer", name, layout, CASES, "x", v["median"], tuple(v["range"]), detail={
        **detail, "loss: max rel. dev.": f"{max(r['loss_dev']):.1e}",
        "grad_norm: max rel. dev.": f"{max(r['grad_norm_dev']):.1e}",
        "final params: max abs diff": f"{r['param_dev']:.1e}", "learning rates": "equal" if r["lr_equal"] else "differ",
        "step s": r["step_s"]["median"]})


def rows(res: Dict[str, Any]) -> List[Row]:
    cases, over = res["cases"], res.get("overhead")
    out = [_case(name, r, res["meta"]) for name, r in cases.items()]
    ours = [n for n in cases if n not in ("plain", "deepspeed_alst") and "error" not in cases[n]]
    alst = cases.get("deepspeed_alst", {}).get("steps")
    for i, w in enumerate(cases["plain"]["steps"]):
        a = alst and alst[i]
        out.append(Row("trainer", f"step {w['step']}", "", STEPS, "", w["loss"], detail={
            "plain grad_norm": w["grad_norm"],
            "ds_seqpar, worst rel. dev. loss / grad_norm": f"{max(cases[n]['loss_dev'][i] for n in ours):.1e} / "
                                                          f"{max(cases[n]['grad_norm_dev'][i] for n in ours):.1e}"
            if ours else "", "ALST loss": a and a["loss"], "ALST grad_norm": a and a["grad_norm"],
            "ALST grad_norm / plain": a and a["grad_norm"] / w["grad_norm"]}))
    out += [Row("trainer", key, f"rank {rank}", GLOO, detail={"raises": f"`{g[key]}`" if g[key] else "nothing"})
            for rank, g in enumerate(res["gloo"]) for key in GLOO_WHAT]
    if over:
        out += [Row("trainer", f"round {i}", "", OVERHEAD, "x", r["ratio"], detail={
            "own loop s/step": r["own_s"], "Trainer s/step": r["trainer_s"], "load (1 min)": r["load_1min"]})
            for i, r in enumerate(over["rounds"], 1)]
        s = over["ratio"]
        out.append(Row("trainer", "median (min-max)", "", OVERHEAD, "x", s["median"], (s["min"], s["max"]),
                       target="trainer", detail={"own loop s/step": over["own_s"]["median"],
                                                 "Trainer s/step": over["trainer_s"]["median"]}))
    return out


def facts(res: Dict[str, Any]) -> Dict[str, Any]:
    m, cases = res["meta"], res["cases"]
    repeatable = all(r.get("repeatable", True) for r in cases.values())
    alst, plain = cases.get("deepspeed_alst", {}), cases["plain"]
    why = ""
    if "steps" in alst:
        ratio = statistics.median(a["grad_norm"] / w["grad_norm"] for a, w in zip(alst["steps"], plain["steps"]))
        why = (" Why DeepSpeed's path is not step-exact (its design, read from transformers' and DeepSpeed's code): "
               "accelerate shards the loader per world rank, so with gradient accumulation 3 (not a multiple of P=2) "
               "an optimizer step does not see plain's samples; the loss is the mean over one micro-batch's tokens, "
               "not the Trainer's sum over the window's (`num_items_in_batch`); every rank of a group back-propagates "
               "the group's whole loss and DeepSpeed divides by the data-parallel size only, so the gradient comes "
               f"out P times plain's (median ALST / plain grad_norm here: {ratio:.3f}).")
    return {
        "title": "Hugging Face Trainer with sequence parallelism on CPU ranks: exactness and step time",
        "setup": f"Load average after the side-by-side part: {m['load_mid']}. Versions: deepspeed {m['deepspeed']}, "
                 f"transformers {m['transformers']}, accelerate {m['accelerate']}, python {m['python']}; "
                 f"{m['world']} gloo ranks of one thread.",
        "command": m["command"], "machine": machine_line(m), "notes": m.get("notes", ""),
        "metrics": {
            CASES: f"examples/hf_trainer.py's tiny Llama-architecture model and data set, right padding to "
                   f"{m['width']} tokens in every case, ZeRO-2, gradient accumulation {m['accumulation']}, AdamW, "
                   f"clipping 1.0, {m['steps']} optimizer steps per run, {m['repeats']} timed rounds after "
                   f"{m['warmup']} untimed. Plain: 4 replicas of micro batch 1; a size-P case 4/P replicas of micro "
                   f"batch P, so every optimizer step covers the same samples. Value: step time / plain, per round, "
                   f"median (min-max). Deviations: round 0, per step |x - plain| / |plain|, the largest (every round "
                   f"logged the same values: {'yes' if repeatable else 'NO'}).",
            STEPS: "Value: plain's loss." + why,
            GLOO: "; ".join(f"{k}: {v}" for k, v in GLOO_WHAT.items()) + ". So every case pads to one width, and the "
                  "ALST case replaces that one backward by what the NCCL path computes (bench/trainer.py).",
            OVERHEAD: f"The same model (`{m['model']}`, random init, fp32), rows of {m['overhead_seq']} tokens, micro "
                      f"batch 1, zigzag P=2 x 2 replicas at ZeRO-2; {m['overhead_steps']} steps per run; rounds "
                      f"alternate own loop (`train.run_training`) / Trainer; the first {m['warmup']} round(s) not "
                      f"counted. Below 1 reads as no overhead this measurement can resolve."}}


__all__ = ["rows", "facts"]
