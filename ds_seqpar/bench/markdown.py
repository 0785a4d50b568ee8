"""The benchmark's markdown page and PNG plots, from the results dict main.py writes as JSON
(so a saved JSON can be re-rendered: ``render_markdown(json.load(f))``)."""
from __future__ import annotations

import os
from typing import Any, Dict, List

from ..report.plotting import MIB
from .cases import CASES


def _f(x, digits=2) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def _spread(s: Dict[str, float], digits=2) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def _ranks(xs, digits=3) -> str:
    return "" if not xs else " / ".join(f"{x:.{digits}f}" for x in xs)


def _header(res: Dict[str, Any]) -> List[str]:
    m, mach = res["meta"], res["machine"]
    lines = [f"# Sequence-parallel benchmark `{m['name']}`", "",
             f"P={m['world']} ranks x 1 thread ({m['device']}, {m['comm_backend']}), {m['dtype']}, "
             f"{'causal' if m['causal'] else 'non-causal'}, batch {m['batch']}, {m['heads']} heads "
             f"({m['kv_heads']} k/v), head_dim {m['head_dim']}, kernel `{m['backend']}`, forward + backward; "
             f"lengths {', '.join(map(str, m['seq_lens']))}; {m['warmup']} warm-up + {m['repeats']} interleaved "
             f"rounds per length; medians over rounds with (min-max).", "",
             f"Command: `{m['command']}`", "",
             f"Machine: {mach['cpu_model']}, {mach['cpus']} cores; load average before {mach['load_before']}, "
             f"after {mach['load_after']}, highest 1-minute value seen during the run {mach['load_peak']:.2f}; "
             f"torch {mach['torch']}, deepspeed {mach['deepspeed']}, python "
             f"{mach['python']}; whole run {res['elapsed_s']:.0f} s.", ""]
    if m["device"] == "cuda":
        lines += ["On CUDA the 'CPU s' columns hold wall seconds between device synchronisations (kernels are "
                  "asynchronous, so host CPU time says nothing).", ""]
    if m.get("notes"):
        lines += [f"Notes: {m['notes']}", ""]
    if mach["loaded"]:
        lines += [f"**The machine was loaded** (1-minute load average above {mach['cpus']} cores at some point "
                  f"of the run): other processes took cores from our ranks, which slows every distributed case more "
                  f"than the single-process baseline (whose peer ranks idle). Treat the wall-clock speedups as lower "
                  f"bounds; the CPU ratio column is the less load-sensitive number.", ""]
    return lines


def _checks_table(res: Dict[str, Any]) -> List[str]:
    lines = [f"## Targets (docs/design.md) at N={max(res['meta']['seq_lens'])}", "",
             "| check | measured | bound | target | result | why, where short |", "|---|---|---|---|---|---|"]
    for c in res["checks"]:
        lines.append(f"| {c['what']} | {_f(c['measured'], 3)} | {_f(c['bound'])} | {c['target']} | "
                     f"**{c['result']}** | {c['why']} |")
    return lines + [""]


def _attention_table(res: Dict[str, Any], seq: int) -> List[str]:
    rows = res["attention"][str(seq)]
    lines = [f"## Attention fwd+bwd at N={seq}", "",
             "| case | wall s (min-max) | speedup (min-max) | bound | target | CPU s per rank | CPU ratio | "
             "imbalance (expected) | work vs single | comm wait s per rank | bytes sent per rank | closed form | "
             "measured / form |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for case, r in rows.items():
        ratio = _ranks(r.get("bytes_ratio"), 3) if r.get("bytes_ratio") else \
            ("not measured (DeepSpeed's own collectives)" if CASES[case].runner == "deepspeed" else "")
        lines.append(
            f"| {case} | {_spread(r['time_s'], 3)} | {_spread(r['speedup'])} | {_f(r['bound'])} | "
            f"{_f(r.get('target'))} | {_ranks(r['cpu_s'])} | {_f(r['cpu_ratio'])} | {_f(r['imbalance'])} "
            f"({_f(r['expected_imbalance'])}) | {_f(r['inflation'])} | {_ranks(r.get('wait_s'))} | "
            f"{' / '.join(map(str, r['bytes'])) if r.get('bytes') else ''} | "
            f"{' / '.join(map(str, r['bytes_form'])) if r.get('bytes_form') else ''} | {ratio} |")
    return lines + [""]


def _sweep_table(res: Dict[str, Any]) -> List[str]:
    seqs = res["meta"]["seq_lens"]
    lines = ["## Speedup vs sequence length", "", "| case | " + " | ".join(f"N={n}" for n in seqs) + " | bound |",
             "|---" * (len(seqs) + 2) + "|"]
    for case in res["meta"]["cases"]:
        cells = [res["attention"][str(n)][case] for n in seqs]
        if cells[0]["baseline"] == case:
            continue
        cols = " | ".join(_spread(c["speedup"]) for c in cells)
        lines.append(f"| {case} | {cols} | {_f(cells[0]['bound'])} |")
    loads = " | ".join(f"{res['load_by_length'][str(n)]:.2f}" for n in seqs)
    lines.append(f"| *1-minute load as the length ended* | {loads} | |")
    return lines + ["", f"![speedup vs sequence length]({res['meta']['name']}/speedup.png)", "",
                    f"![bytes per rank]({res['meta']['name']}/bytes.png)", ""]


def _memory_tables(res: Dict[str, Any]) -> List[str]:
    m, seq = res["meta"], max(res["meta"]["seq_lens"])
    lines = [f"## Activation memory (bytes saved for backward) at N={seq}", "",
             "| case | MiB per rank | baseline MiB | fullest rank / baseline | 1/P |", "|---|---|---|---|---|"]
    for case, r in res["attention"][str(seq)].items():
        base = res["attention"][str(seq)][r["baseline"]]["saved_bytes"][0]
        lines.append(f"| {case} | {_ranks([b / MIB for b in r['saved_bytes']], 2)} | {base / MIB:.2f} | "
                     f"{r['mem_ratio']:.4f} | {1 / m['world']:.4f} |")
    if res.get("max_seq"):
        lines += ["", f"Longest sequence whose saved bytes fit, on the fullest rank, a budget equal to what the "
                  f"single-process kernel saves at N={m['mem_budget_n']} (forward only, searched in steps of "
                  f"{next(iter(res['max_seq'].values()))['step']} tokens):", "",
                  "| case | budget MiB | longest N | vs baseline |", "|---|---|---|---|"]
        lines += [f"| {case} | {r['budget_bytes'] / MIB:.2f} | {r['max_seq']} | {r['ratio']:.3f} |"
                  for case, r in res["max_seq"].items()]
    return lines + ["", f"![memory per rank]({m['name']}/memory.png)", "",
                    f"![imbalance]({m['name']}/imbalance.png)", ""]


def _peer_tables(res: Dict[str, Any]) -> List[str]:
    lines = []
    seqs = res["meta"]["seq_lens"]
    if "ds_ulysses" in res["meta"]["cases"] and "ulysses" in res["meta"]["cases"]:
        lines += ["## Ours vs DeepSpeed's Ulysses (`deepspeed.sequence.layer.DistributedAttention`, same local kernel)",
                  "", "| N | ours s | DeepSpeed s | ours / theirs, paired per round (min-max) |", "|---|---|---|---|"]
        for n in seqs:
            ours, theirs = res["attention"][str(n)]["ulysses"], res["attention"][str(n)]["ds_ulysses"]
            lines.append(f"| {n} | {ours['time_s']['median']:.4f} | {theirs['time_s']['median']:.4f} | "
                         f"{_spread(theirs['ours_over_theirs'], 3)} |")
        lines.append("")
    if "lasp1" in res["meta"]["cases"] and "lasp2" in res["meta"]["cases"]:
        lines += _lasp_table(res)
    return lines


def _lasp_table(res: Dict[str, Any]) -> List[str]:
    """LASP-1 against LASP-2 and, with the halves case, what the states cost over that bound."""
    halves = "halves" in res["meta"]["cases"]
    extra = " halves speedup | LASP-2 / halves time | LASP-1 / halves time |" if halves else ""
    lines = ["## LASP-1 (ring) vs LASP-2 (all-gather)", "",
             "| N | LASP-2 speedup | LASP-1 speedup | LASP-1 / LASP-2 time |" + extra,
             "|---" * (7 if halves else 4) + "|"]
    for n in res["meta"]["seq_lens"]:
        rows = res["attention"][str(n)]
        t1, t2 = rows["lasp1"]["time_s"]["median"], rows["lasp2"]["time_s"]["median"]
        line = f"| {n} | {_spread(rows['lasp2']['speedup'])} | {_spread(rows['lasp1']['speedup'])} | {t1 / t2:.2f} |"
        if halves:
            th = rows["halves"]["time_s"]["median"]
            line += f" {_spread(rows['halves']['speedup'])} | {t2 / th:.2f} | {t1 / th:.2f} |"
        lines.append(line)
    return lines + [""] + _lasp_breakdown_table(res)


def _lasp_breakdown_table(res: Dict[str, Any]) -> List[str]:
    found = res.get("lasp_breakdown")
    if not found:
        return []
    base = next(iter(found["cpu_s"].values()))
    lines = [f"Kernel work of one fwd+bwd at the local length N/P = {found['local_len']} (rank 0's process "
             f"after the rounds, no transfers, median CPU s; extra = over the block with no states, which is "
             f"what halves runs):", "", "| rank position | CPU s | extra |", "|---|---|---|"]
    lines += [f"| {name} | {t:.4f} | {t / base - 1:+.1%} |" for name, t in found["cpu_s"].items()]
    return lines + [""]


def _train_table(res: Dict[str, Any]) -> List[str]:
    if not res.get("train"):
        return [f"## Training step\n\n{res.get('train_skipped', 'not measured')}\n"]
    t = res["train_model"]
    p = res["meta"]["world"]
    what = (f"Hugging Face model `{os.path.basename(t['model'])}`" if t.get("model") else
            f"Model dim {t['dim']}, {t['n_layers']} layers, {t['n_heads']} heads")
    lines = [f"## Whole training step, {'Hugging Face model' if t.get('model') else 'small LM'}, ZeRO-2 "
             f"(sp=P, dp=1 vs one rank)", "",
             f"{what}, sequence {t['seq_len']}, "
             f"micro-batch {t['micro_batch']}, {t['steps']} steps per run (the first is warm-up), through "
             f"train.run_training; rounds alternate the 1-rank and the {p}-rank run. Compute speedup: the "
             f"busiest rank's fwd+bwd process CPU time (compute_s_max), 1 rank over {p}. Highest 1-minute load "
             f"seen between rounds: {max(r['max_load_1min'] for r in res['train'].values()):.2f}.", "",
             f"| strategy | 1 rank s/step | {p} ranks s/step | speedup (min-max) | fwd+bwd compute speedup | bound | "
             f"target | tokens/s 1 -> {p} | losses, max rel diff |", "|---|---|---|---|---|---|---|---|---|"]
    for s, r in res["train"].items():
        tok = r["tokens_per_s"]
        lines.append(f"| {s} | {_spread(r['one_s'], 3)} | {_spread(r['p_s'], 3)} | {_spread(r['speedup'])} | "
                     f"{_spread(r['compute_speedup'])} | {r['bound']:.2f} | {r['target']:.2f} | "
                     f"{tok[0]:.0f} -> {tok[1]:.0f} | {r['loss_rel_diff']:.1e} |")
    return lines + [""]


DEFINITIONS = """## How to read it

- wall s: per round, the slowest rank's wall time; speedup: per round, baseline / case (baseline:
  the single-process kernel on the whole sequence, one thread on rank 0 while the others idle;
  `single` for softmax cases, `single_linear` for LASP), median and (min-max) over rounds.
- CPU s per rank: the main thread's CPU time (the compute; a rank blocked in a collective burns
  little). CPU ratio = baseline CPU / busiest rank's CPU: the speedup without communication and
  scheduling. imbalance = max/mean CPU over ranks (expected value in parentheses). work vs single
  = sum of per-rank CPU / baseline CPU (1.00: no work added by splitting).
- comm wait: seconds a rank sat blocked in communication (CommStats); bytes: what CommStats
  recorded per rank for one fwd+bwd, against `strategies/closed_form.py`.
- Targets are docs/design.md's figures at P=2 taken as a fraction of each bound (see bench/summary.py).
"""
HALVES = """- halves: every rank runs the single-process kernel on its own N/P tokens and exchanges
  nothing: not attention over the sequence but the bound no exact scheme beats here (ranks
  running at once share caches and memory bandwidth).
"""


def render_markdown(res: Dict[str, Any]) -> str:
    seq = max(res["meta"]["seq_lens"])
    parts = (_header(res) + _checks_table(res) + _attention_table(res, seq) + _sweep_table(res)
             + _memory_tables(res) + _peer_tables(res) + _train_table(res) + [DEFINITIONS])
    if "halves" in res["meta"]["cases"]:
        parts.append(HALVES)
    return "\n".join(parts)


def write_report(res: Dict[str, Any], out_dir: str) -> str:
    """reports/<name>.md and reports/<name>/*.png; returns the markdown path."""
    from .plots import write_plots
    name = res["meta"]["name"]
    write_plots(res, os.path.join(out_dir, name))
    path = os.path.join(out_dir, f"{name}.md")
    with open(path, "w") as f:
        f.write(render_markdown(res))
    return path


__all__ = ["render_markdown", "write_report"]
