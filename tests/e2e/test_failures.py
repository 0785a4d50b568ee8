"""A rank killed (SIGKILL) ends the job within seconds; a hung rank ends it within the collective
timeout, named in the message. (Raising ranks under each launcher: test_launchers.py.
Subprocess tests: deselect with -m "not launcher".)"""
import re

import pytest

from ds_seqpar.train import faults

from .test_launchers import FAST_EXIT_S, FAULT_NPROC, LAUNCH, MATRIX, TINY, config, run_with_fault

HANG_TIMEOUT_S = 10


@pytest.mark.launcher
def test_killed_rank_ends_the_job_and_is_named(tmp_path):
    # no launcher: spawn_local is the launcher here, and says which rank died
    cmd = [*LAUNCH["nprocs"](FAULT_NPROC), "--deepspeed_config", config(tmp_path, timeout_s=60), *TINY,
           "--no_wandb", "--run_dir", str(tmp_path / "runs")]
    code, out, secs = run_with_fault(cmd, "1:0:kill")
    assert code == 128 + 9, out[-3000:]
    assert "ds_seqpar.train: rank 1 was killed by SIGKILL" in out, out[-3000:]
    assert secs < FAST_EXIT_S, f"the job ended {secs:.1f}s after rank 1 was killed\n{out[-3000:]}"


@pytest.mark.launcher
@pytest.mark.parametrize("launcher", [p for p in MATRIX if p.values == ("mpirun",)])
def test_hung_rank_is_named_and_the_run_stops_within_the_timeout(launcher, tmp_path):
    cmd = [*LAUNCH[launcher](FAULT_NPROC), "--deepspeed_config", config(tmp_path, timeout_s=HANG_TIMEOUT_S),
           *TINY, "--no_wandb", "--run_dir", str(tmp_path / "runs")]
    code, out, secs = run_with_fault(cmd, "1:0:hang")
    assert code != 0, out[-3000:]
    # rank 0 names the ranks missing from its monitored barrier: the hung one among them
    assert re.search(r"rank\(s\) (\d+, )*1(, \d+)* stopped responding", out), out[-3000:]
    # gloo's own words for the timeout: the monitored wait's (at 4 ranks, seen every run) or the pair's closure
    # (at 2 ranks the peer's pair may time out first; seen on a fresh machine's run)
    timed_out = f"Timed out waiting {HANG_TIMEOUT_S * 1000}ms" in out or "Application timeout caused pair closure" in out
    assert timed_out and "sequence_parallel.timeout_s bounds the wait" in out, out[-3000:]
    assert secs < HANG_TIMEOUT_S + FAST_EXIT_S, f"took {secs:.0f}s after the hang"


def test_fault_spec_is_validated():
    assert faults.parse("1:2:hang") == (1, 2, "hang")
    assert faults.parse("0:0:interrupt") == (0, 0, "interrupt")
    with pytest.raises(ValueError, match="mode 'explode' is not one of raise, interrupt, kill, hang"):
        faults.parse("1:2:explode")
    with pytest.raises(ValueError, match="must be '<rank>:<step>:<mode>'"):
        faults.parse("1")
