"""A host lost mid-training: its link cut (ranks started as a Slurm job step's tasks, with srun's
environment on each host; LASP over both hosts: the steps before the cut equal one host's), or its
rank processes killed (`deepspeed --hostfile` through pdsh, the 2D hybrid). Every
surviving rank ends within the bound, naming the ranks and the host it lost, and the launchers exit
non-zero (pdsh's exit code included). The killed job's checkpoint then resumes on the surviving host
alone (half the ranks, through the universal checkpoint) and gives the loss the lost job logged for
that step. (torchrun --max-restarts, which restarts a killed host's ranks, is in
test_across_hosts.py.)"""
import os
import re
import signal
import time

import pytest

from . import jobs
from .conftest import needs

pytestmark = [pytest.mark.multinode, pytest.mark.launcher]
TIMEOUT_S = 20               # sequence_parallel.timeout_s of these jobs: a cut link is noticed after it
STEPS = 400                  # more than run before the fault: it comes mid-training
STARTUP_S = 240


def start_and_wait_for_steps(job, runs):
    try:
        jobs.wait_for(lambda: jobs.steps_logged(runs) >= 2, STARTUP_S, "two logged steps")
    except TimeoutError:
        job.close()
        raise AssertionError(f"the job never trained:\n{job.output or ''}") from None
    pids = jobs.rank_pids(runs)
    assert sorted(pids) == [0, 1, 2, 3], pids
    return pids


def failure_lines(out, ranks):
    return {r: [line for line in out.splitlines() if f"ds_seqpar.train: rank {r} failed:" in line] for r in ranks}


def names(line, ranks, host, addr, state):
    listed = ", ".join(map(str, ranks))
    return f"rank(s) {listed} {state} [host {host} ({addr}): rank(s) {listed}]" in line


def test_link_down_mid_training_every_rank_ends_naming_the_other_host(fresh, pool, tmp_path):
    hosts = fresh
    runs = str(tmp_path / "runs")
    # a linear-attention LM under LASP over both hosts: its steps before the cut are one host's
    model = ["--deepspeed_config", jobs.ds_config(tmp_path, strategy="lasp", size=4, timeout_s=TIMEOUT_S),
             "--attention", "linear", *jobs.TINY]
    cfg = [*model, "--steps", str(STEPS), "--run_dir", runs]
    job = jobs.Job(jobs.slurm_tasks(hosts, 29621, cfg), hosts.env())         # the tasks of a Slurm job step
    try:
        pids = start_and_wait_for_steps(job, runs)
        hosts.link("dsmn-b", "down")
        cut = time.time()
        # the one-host reference trains while the job's ranks wait out timeout_s (blocked, not computing)
        one_host = jobs.losses(jobs.train_on_pool(pool, [*model, "--steps", "2"], str(tmp_path / "one_host")))
        ends = jobs.watch_ends(pids, TIMEOUT_S + 30, since=cut)
        codes = job.wait(30)
    finally:
        job.close()
    out = job.output
    print(f"link down: ranks ended after {ends} s; launchers exited {codes}")      # shown with -s
    assert all(t is not None for t in ends.values()), f"ranks still running {TIMEOUT_S + 30}s after the cut: {ends}\n{out[-6000:]}"
    assert all(c not in (0, None) for c in codes), f"launcher exit codes {codes}\n{out[-6000:]}"
    said = failure_lines(out, range(4))
    # host a's ranks lost ranks 2, 3; host b's lost the store and ranks 0, 1 with it
    for r in (0, 1):
        assert all(names(line, [2, 3], "dsmn-b", "10.77.0.2", "stopped responding") for line in said[r]), said
    for r in (2, 3):
        assert all(names(line, [0, 1], "dsmn-a", "10.77.0.1", "unreachable") for line in said[r]), said
    assert said[0] + said[1] and said[2] + said[3], f"a host's ranks said nothing:\n{out[-6000:]}"
    assert jobs.losses(runs)[:2] == one_host


@needs("pdsh")
def test_killed_host_every_survivor_ends_naming_it_and_pdsh_fails(fresh, tmp_path):
    hosts = fresh
    runs = str(tmp_path / "runs")
    saved = str(tmp_path / "ckpt")
    ds_json = jobs.ds_config(tmp_path, strategy="zigzag", size=4, ulysses_size=2, timeout_s=TIMEOUT_S)
    cfg = ["--deepspeed_config", ds_json, "--steps", str(STEPS), *jobs.TINY, "--run_dir", runs,
           "--save_dir", saved, "--save_interval", "1"]
    env = dict(hosts.env(), DS_ENV_FILE=os.path.join(str(tmp_path), ".deepspeed_env"))
    # step 1's checkpoint is complete once step 2 is logged (it was saved before): host a alone resumes it
    # at 2 ranks (zigzag over both, 1 data replica as before: the same global batch), started as soon as
    # host b is killed, while the survivors wait out their census of the lost ranks (idle seconds)
    resumed_runs = str(tmp_path / "resumed")
    again = ["--deepspeed_config", ds_json, "--sp_size", "2", "--ulysses_size", "1", "--steps", "2", *jobs.TINY,
             "--run_dir", resumed_runs, "--save_dir", saved, "--resume_universal", "--resume_tag", "step1"]
    job = jobs.Job([jobs.deepspeed_hostfile(hosts, tmp_path, "pdsh", 29622, cfg)], env)
    resume = None
    try:
        pids = start_and_wait_for_steps(job, runs)
        for r in (2, 3):
            os.kill(pids[r], signal.SIGKILL)
        killed = time.time()
        resume = jobs.Job([jobs.torchrun_on(hosts, 0, 29623, again, nnodes=1)], hosts.env())
        ends = jobs.watch_ends({r: pids[r] for r in (0, 1)}, 60, since=killed)
        codes = job.wait(60 - (time.time() - killed))
        out = job.output
        print(f"host b killed: ranks 0, 1 ended after {ends} s; deepspeed (pdsh) exited {codes}")
        assert all(t is not None for t in ends.values()), f"survivors still running 60s after the kill: {ends}\n{out[-6000:]}"
        assert codes[0] not in (0, None), f"deepspeed/pdsh exit code {codes}\n{out[-6000:]}"
        said = failure_lines(out, (0, 1))
        assert said[0] + said[1], f"no survivor said what failed:\n{out[-6000:]}"
        for line in said[0] + said[1]:
            assert names(line, [2, 3], "dsmn-b", "10.77.0.2", "stopped responding"), line
            assert not re.search(r"own error is above", line), line
        # its step 2 is the lost job's step 2
        lost = jobs.losses(runs)
        assert resume.wait(STARTUP_S) == [0], resume.output[-4000:]
    finally:
        job.close()
        if resume is not None:
            resume.close()
    (step2,) = jobs.losses(resumed_runs)
    assert abs(step2 - lost[1]) <= 1e-5 * lost[1], f"resumed on one host: step 2 loss {step2} vs the lost job's {lost[1]}"
