"""``ds-seqpar dashboard --entity E --project P``: a saved wandb workspace view that compares strategies.

Runs of the main job (``python -m ds_seqpar.train``) and of SequenceParallelTrainer log one vocabulary
(docs/dashboards.md): the view groups them by strategy, size and model (config keys both write) and
shows, per step, the loss, tokens/s, step time, the attention's bytes and seconds, the compute
imbalance across a sequence group and the memory (static, peak, above static), with a runs table.

    ds-seqpar dashboard --entity my-team --project ds_seqpar            # saves the view, prints its URL
    ds-seqpar dashboard --entity E --project P --dry-run view.json      # the definition only, no network

The definition is plain data (``definition``); ``build`` turns it into wandb-workspaces objects
(``pip install 'ds_seqpar[dashboard]'``), which only ``save`` sends.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, Optional

X_AXIS = "train/step"                                    # the optimizer step, in both entry points
GROUP_BY = ("strategy", "sp_size", "model_name")         # run config keys
# (section, title, metric keys): every key is logged by both entry points (tests/tools/test_dashboard.py)
PANELS = (
    ("Training", "loss", ("train/loss",)),
    ("Throughput", "tokens per second", ("train/tokens_per_s",)),
    ("Throughput", "step time (s)", ("train/step_s",)),
    ("Attention communication", "bytes per step (largest rank)", ("train/attn_comm_bytes",)),
    ("Attention communication", "seconds per step (largest rank)", ("train/attn_comm_s",)),
    ("Balance", "compute imbalance in a sequence group (max / mean)", ("train/compute_imbalance",)),
    ("Memory", "memory per step, MiB (static / peak / above static)",
     ("train/static_mem_mb", "train/peak_mem_mb", "train/step_mem_mb")),
)
TABLE = ("config:strategy", "config:sp_size", "config:dp_size", "config:model_name", "summary:train/tokens_per_s",
         "summary:train/step_s", "summary:train/attn_comm_bytes", "summary:train/peak_mem_mb")


def definition(entity: str, project: str, name: str = "ds_seqpar: strategies") -> Dict[str, Any]:
    """The view as plain data (what --dry-run writes)."""
    sections: List[Dict[str, Any]] = []
    for section, title, keys in PANELS:
        if not sections or sections[-1]["name"] != section:
            sections.append({"name": section, "panels": []})
        sections[-1]["panels"].append({"type": "line", "title": title, "x": X_AXIS, "y": list(keys)})
    sections.append({"name": "Runs", "panels": [{"type": "run_comparer"}]})
    return {"entity": entity, "project": project, "name": name, "x_axis": X_AXIS, "group_by": list(GROUP_BY),
            "table_columns": list(TABLE), "sections": sections}


def metric_keys(view: Dict[str, Any]) -> List[str]:
    """Every metric the view names: the panels' axes and the table's summary columns."""
    keys = [view["x_axis"]] + [k for s in view["sections"] for p in s["panels"] for k in p.get("y", [])]
    keys += [c.split(":", 1)[1] for c in view["table_columns"] if c.startswith("summary:")]
    return sorted(set(keys))


def build(view: Dict[str, Any]):
    """The wandb-workspaces Workspace for ``view`` (no network until .save())."""
    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    except ImportError:
        raise SystemExit("ds-seqpar dashboard: needs wandb-workspaces: pip install 'ds_seqpar[dashboard]' "
                         "(or --dry-run FILE for the definition alone)") from None

    def panel(p):
        if p["type"] == "run_comparer":
            return wr.RunComparer(diff_only="split")
        return wr.LinePlot(title=p["title"], x=p["x"], y=list(p["y"]))

    sections = [ws.Section(name=s["name"], panels=[panel(p) for p in s["panels"]], is_open=True)
                for s in view["sections"]]
    runset = ws.RunsetSettings(groupby=[ws.Config(k) for k in view["group_by"]],
                               pinned_columns=list(view["table_columns"]))
    return ws.Workspace(entity=view["entity"], project=view["project"], name=view["name"], sections=sections,
                        settings=ws.WorkspaceSettings(x_axis=view["x_axis"]), runset_settings=runset)


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog="ds-seqpar dashboard", description="Create a saved wandb workspace view "
                                "comparing sequence-parallel runs (strategy, size, model) of this project.")
    p.add_argument("--entity", required=True, help="wandb entity (user or team)")
    p.add_argument("--project", required=True, help="wandb project the runs log to")
    p.add_argument("--name", default="ds_seqpar: strategies", help="the view's name")
    p.add_argument("--dry-run", metavar="FILE", default=None, help="write the view's definition as JSON to FILE "
                   "('-': stdout) and stop: no network, no wandb-workspaces needed")
    opts = p.parse_args(argv)
    view = definition(opts.entity, opts.project, opts.name)
    if opts.dry_run is not None:
        text = json.dumps(view, indent=1)
        if opts.dry_run == "-":
            print(text)
        else:
            with open(opts.dry_run, "w") as f:
                f.write(text + "\n")
        return 0
    workspace = build(view)
    workspace.save()
    print(workspace.url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
