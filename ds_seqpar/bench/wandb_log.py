"""Benchmark results to wandb: one run per case (and per training strategy), all in the group named
after the bench, so a strategy's runs from several benches line up in wandb's UI. Offline when no
credentials are in the environment (as runlog does for training): ``wandb sync <dir>`` uploads."""
from __future__ import annotations

import os
from typing import Any, Dict, List

from ..report.render import result
from ..report.rows import Row
from ..train.runlog import wandb_mode


def _case_metrics(row: Dict[str, Any]) -> Dict[str, float]:
    m = {"seq_len": row["seq"], "time_s": row["time_s"]["median"], "speedup": row["speedup"]["median"],
         "speedup_min": row["speedup"]["min"], "speedup_max": row["speedup"]["max"], "bound": row["bound"],
         "cpu_s_max": max(row["cpu_s"]), "cpu_ratio": row["cpu_ratio"], "imbalance": row["imbalance"],
         "work_inflation": row["inflation"], "saved_bytes_per_rank": max(row["saved_bytes"]),
         "mem_ratio": row["mem_ratio"]}
    if row.get("bytes"):
        m.update(bytes_per_rank=max(row["bytes"]), bytes_ratio=max(row["bytes_ratio"] or [float("nan")]))
    if row.get("bytes_form"):
        m["bytes_closed_form"] = max(row["bytes_form"])
    if "ours_over_theirs" in row:
        m["ulysses_ours_over_deepspeed"] = row["ours_over_theirs"]["median"]
    return m


def log_bench(res: Dict[str, Any], rows: List[Row], run_dir: str, project: str) -> None:
    import wandb
    meta = res["meta"]
    os.makedirs(run_dir, exist_ok=True)
    common = dict(project=project, group=meta["name"], dir=os.path.abspath(run_dir), mode=wandb_mode(),
                  job_type="bench", tags=[meta["device"], f"P{meta['world']}", meta["dtype"]])
    for case in meta["cases"]:
        run = wandb.init(name=f"{meta['name']}/{case}", config=dict(meta, case=case, machine=res["machine"]), **common)
        wandb.define_metric("bench/*", step_metric="bench/seq_len")
        for n in meta["seq_lens"]:
            run.log({f"bench/{k}": v for k, v in _case_metrics(res["attention"][str(n)][case]).items()})
        if case in res.get("max_seq", {}):
            run.summary["max_seq"] = res["max_seq"][case]["max_seq"]
            run.summary["max_seq_ratio"] = res["max_seq"][case].get("ratio")
        run.summary["checks"] = [{"metric": r.metric, "variant": r.variant, "value": max(r.values()),
                                  "result": result(r)} for r in rows if r.case == case and r.target]
        run.finish()
    for strategy, t in res.get("train", {}).items():
        run = wandb.init(name=f"{meta['name']}/train-{strategy}", config=dict(meta, case=f"train-{strategy}",
                         model=res["train_model"], machine=res["machine"]), **common)
        run.summary.update({"train/speedup": t["speedup"]["median"], "train/step_s_1": t["one_s"]["median"],
                            "train/step_s_P": t["p_s"]["median"], "train/loss_rel_diff": t["loss_rel_diff"]})
        run.finish()


__all__ = ["log_bench"]
