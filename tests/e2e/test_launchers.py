"""The main job under real launchers (subprocesses: slow, so tiny and few; deselect with
``-m "not launcher"``): deepspeed, mpirun, and the command with no launcher at all."""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from ds_seqpar.launch.env import free_port

pytestmark = pytest.mark.launcher

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
TINY = ["--deepspeed_config", "configs/ulysses_zero2.json", "--steps", "2", "--seq_len", "64", "--dim", "32",
        "--n_layers", "2", "--corpus_bytes", "262144", "--no_progress"]


def run(cmd, tmp_path, timeout=300, **env):
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", PYTHONUNBUFFERED="1", **env)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def metrics_of(run_dir, steps):
    (name,) = os.listdir(run_dir)
    with open(os.path.join(run_dir, name, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), rows
    assert all(math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in rows), rows
    with open(os.path.join(run_dir, name, "run.json")) as f:
        return rows, json.load(f)


@pytest.mark.skipif(shutil.which("deepspeed") is None, reason="deepspeed launcher not on PATH")
def test_deepspeed_launcher_trains_and_logs_to_jsonl_and_wandb(tmp_path):
    runs = tmp_path / "runs"
    code, out = run(["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "--module",
                     "ds_seqpar.train", *TINY, "--run_dir", str(runs)], tmp_path)
    assert code == 0, out[-4000:]
    rows, config = metrics_of(runs, 2)
    assert config["sp_size"] == 2 and config["dp_size"] == 1 and config["world_size"] == 2, config
    assert "metrics ->" in out and "wandb run ->" in out, out[-4000:]
    wandb_dirs = list((runs / os.listdir(runs)[0] / "wandb").glob("offline-run-*"))
    assert wandb_dirs, f"no offline wandb run under {runs}"


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not on PATH")
def test_mpirun_trains_through_mpi_discovery(tmp_path):
    runs = tmp_path / "runs"
    code, out = run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, "-m",
                     "ds_seqpar.train", *TINY, "--no_wandb", "--master_port", str(free_port()),
                     "--run_dir", str(runs)], tmp_path)
    assert code == 0, out[-4000:]
    metrics_of(runs, 2)


def test_no_launcher_spawns_local_ranks_and_a_bad_config_exits_with_one_message(tmp_path):
    code, out = run([sys.executable, "-m", "ds_seqpar.train", *TINY, "--nprocs", "2", "--n_heads", "3",
                     "--dim", "48",
                     "--no_wandb", "--run_dir", str(tmp_path / "runs")], tmp_path)
    assert code == 2, out[-4000:]
    errors = [line for line in out.splitlines() if line.startswith("ds_seqpar.train: error:")]
    assert len(errors) == 2 and len(set(errors)) == 1, out[-4000:]
    assert "3 q heads are not divisible by 2" in errors[0], errors[0]
    assert "Traceback" not in out, out[-4000:]


@pytest.mark.skipif(shutil.which("deepspeed") is None, reason="deepspeed launcher not on PATH")
def test_deepspeed_launcher_trains_a_hugging_face_model(tmp_path):
    """--model with the shipped Qwen2 config (random init), ring attention, wandb on (offline)."""
    runs = tmp_path / "runs"
    code, out = run(["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "--module",
                     "ds_seqpar.train", "--model", "configs/models/qwen2_small.json", "--deepspeed_config",
                     "configs/ring_zero2.json", "--steps", "2", "--seq_len", "64", "--corpus_bytes", "65536",
                     "--no_progress", "--run_dir", str(runs)], tmp_path)
    assert code == 0, out[-4000:]
    rows, config = metrics_of(runs, 2)
    assert config["model"]["architecture"] == "Qwen2Config" and config["strategy"] == "ring", config
    assert list((runs / os.listdir(runs)[0] / "wandb").glob("offline-run-*")), f"no offline wandb run under {runs}"
