"""A rank that raises, dies or hangs mid-step stops the whole run, non-zero, within the collective
timeout, with a message naming the failing rank: under the deepspeed launcher and under mpirun.
(Subprocess tests: deselect with -m "not launcher".)"""
import json
import os
import sys
import time

import pytest

from ds_seqpar.train import faults
from ds_seqpar.launch.env import free_port

from .test_launchers import ROOT, run

pytestmark = pytest.mark.launcher
TIMEOUT_S = 10
ARGS = ["--steps", "3", "--seq_len", "64", "--dim", "32", "--n_layers", "2", "--corpus_bytes", "262144",
        "--no_progress", "--no_wandb"]


def _config(tmp_path):
    with open(os.path.join(ROOT, "configs", "ulysses_zero2.json")) as f:
        ds = json.load(f)
    ds["sequence_parallel"]["timeout_s"] = TIMEOUT_S
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    return str(path)


def _deepspeed(tmp_path, fault):
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "--module", "ds_seqpar.train",
           "--deepspeed_config", _config(tmp_path), *ARGS, "--run_dir", str(tmp_path / "runs")]
    start = time.monotonic()
    code, out = run(cmd, tmp_path, timeout=240, DS_SEQPAR_FAULT=fault)
    return code, out, time.monotonic() - start


def test_killed_rank_stops_the_deepspeed_launcher(tmp_path):
    code, out, secs = _deepspeed(tmp_path, "1:1:kill")
    assert code != 0, out[-3000:]
    assert "--local_rank=1" in out and "exits with return code = -9" in out, out[-3000:]
    assert "rank 0 failed" in out, out[-3000:]


def test_hung_rank_is_named_and_the_run_stops_within_the_timeout(tmp_path):
    code, out, secs = _deepspeed(tmp_path, "1:1:hang")
    assert code != 0, out[-3000:]
    assert "rank(s) 1 stopped responding" in out, out[-3000:]
    assert f"Timed out waiting {TIMEOUT_S * 1000}ms" in out, out[-3000:]
    assert secs < 150, f"took {secs:.0f}s"


def test_raising_rank_stops_mpirun(tmp_path):
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, "-m", "ds_seqpar.train",
           "--deepspeed_config", _config(tmp_path), *ARGS, "--master_port", str(free_port()),
           "--run_dir", str(tmp_path / "runs")]
    code, out = run(cmd, tmp_path, timeout=240, DS_SEQPAR_FAULT="1:1:raise")
    assert code != 0, out[-3000:]
    assert "rank 1 failed: InjectedFault: injected fault on rank 1 at step 1" in out, out[-3000:]


def test_fault_spec_is_validated():
    assert faults.parse("1:2:hang") == (1, 2, "hang")
    with pytest.raises(ValueError, match="mode 'explode' is not one of raise, kill, hang"):
        faults.parse("1:2:explode")
    with pytest.raises(ValueError, match="must be '<rank>:<step>:<mode>'"):
        faults.parse("1")
