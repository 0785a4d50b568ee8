"""``ds-seqpar dashboard`` (ds_seqpar/dashboard.py): the view's definition, its wandb-workspaces form, and
the contract that keeps it working: every metric a panel or the runs table names, and every config key
it groups by, is in the offline wandb runs of the main job and of SequenceParallelTrainer (a renamed
metric fails here)."""
import json
import os

import pytest

from ds_seqpar import dashboard

from .test_hf_trainer import ds_config, run_with_wandb


def test_dry_run_writes_the_definition_without_network(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = tmp_path / "view.json"
    assert dashboard.main(["--entity", "e", "--project", "p", "--dry-run", str(out)]) == 0
    view = json.loads(out.read_text())
    assert view == dashboard.definition("e", "p")
    assert view["group_by"] == ["strategy", "sp_size", "model_name"] and view["x_axis"] == "train/step"
    panels = {p["title"]: p["y"] for s in view["sections"] for p in s["panels"] if p["type"] == "line"}
    assert panels["memory per step, MiB (static / peak / above static)"] == \
        ["train/static_mem_mb", "train/peak_mem_mb", "train/step_mem_mb"]
    assert {"train/loss", "train/tokens_per_s", "train/step_s", "train/attn_comm_bytes", "train/attn_comm_s",
            "train/compute_imbalance"} <= set(dashboard.metric_keys(view))


def test_the_workspace_has_the_definitions_panels_and_saving_prints_its_url(monkeypatch, capsys):
    pytest.importorskip("wandb_workspaces")
    view = dashboard.definition("e", "p")
    workspace = dashboard.build(view)
    lines = [[p.x] + list(p.y) for s in workspace.sections for p in s.panels if hasattr(p, "y")]
    assert lines == [[p["x"]] + p["y"] for s in view["sections"] for p in s["panels"] if p["type"] == "line"]
    assert [g.name for g in workspace.runset_settings.groupby] == view["group_by"]
    assert workspace.runset_settings.pinned_columns[1:] == view["table_columns"]

    class Saved:
        url = "https://wandb.ai/e/p?nw=view"

        def save(self):
            self.saved = True
    saved = Saved()
    monkeypatch.setattr(dashboard, "build", lambda v: saved)
    assert dashboard.main(["--entity", "e", "--project", "p"]) == 0 and saved.saved
    assert capsys.readouterr().out.strip() == Saved.url


def main_job_run(directory):
    """On every rank: a 2-step main-job run logging to wandb offline; rank 0 returns the summary and config
    of its wandb run (read as the run finishes: an offline run writes no summary file) and its name."""
    import wandb
    from ds_seqpar.train import run_training, runlog
    finish, seen, mode = runlog.wandb_finish, {}, os.environ.get("WANDB_MODE")

    def finish_and_keep():
        if wandb.run is not None:
            seen.update(summary=dict(wandb.run.summary), config=dict(wandb.run.config), name=wandb.run.name)
        finish()
    runlog.wandb_finish, os.environ["WANDB_MODE"] = finish_and_keep, "offline"
    try:
        run_training({"dim": 32, "n_layers": 2, "seq_len": 64, "steps": 2, "corpus_bytes": 1 << 18, "quiet": True,
                      "run_dir": directory})
    finally:
        runlog.wandb_finish = finish
        # the pool's ranks outlive this test: the mode they had (conftest's offline) stays for the next
        os.environ.pop("WANDB_MODE") if mode is None else os.environ.update(WANDB_MODE=mode)
    return (seen["summary"], seen["config"], seen["name"]) if seen else None


def assert_has_the_views_keys(what, summary, config):
    view = dashboard.definition("e", "p")
    missing = [k for k in dashboard.metric_keys(view) if k not in summary]
    assert not missing, f"{what}: the view names metrics its runs do not log: {missing} (logged: {sorted(summary)})"
    assert all(k in config for k in view["group_by"]), (what, sorted(config))


def test_the_main_jobs_runs_log_every_key_the_view_names(pool, tmp_path):
    summary, config, name = pool.run(main_job_run, str(tmp_path))[0]
    assert_has_the_views_keys("main job", summary, config)
    assert (config["strategy"], config["sp_size"], config["model_name"]) == ("zigzag", 2, "lm-l2-d32"), config
    assert name.startswith("lm-l2-d32-zigzag-sp2-n64-dp2-"), name          # run names carry the model


def test_the_trainers_runs_log_every_key_the_view_names(pool, tmp_path):
    cfg = ds_config(2, strategy="zigzag", size=2)
    cfg["wandb"] = {"enabled": True, "project": "ds_seqpar_test"}
    _, (summary, config) = pool.run(run_with_wandb, cfg, 2, str(tmp_path))[0]
    assert_has_the_views_keys("SequenceParallelTrainer", summary, config)
    assert (config["strategy"], config["sp_size"], config["model_name"]) == ("zigzag", 2, "llama"), config
    assert summary["train/attn_comm_bytes"] > 0 and summary["train/tokens_per_s"] > 0, summary
