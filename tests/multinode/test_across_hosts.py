"""Exact across hosts: the main job's per-step losses at 2 hosts x 2 ranks equal one host x 4 ranks
(the session's pool), under torchrun on every host (zigzag over a slow link that queues and drops
packets: a `tc tbf` token bucket on both hosts, this kernel has no `netem`; with --max-restarts, a
killed host's ranks restart from the latest checkpoint) and under `deepspeed --hostfile` with its
openmpi launcher (the 2D hybrid; pdsh is test_faults.py's); run.json says which host each rank ran on."""
import os
import re
import signal

import pytest

from . import jobs
from .conftest import needs

pytestmark = [pytest.mark.multinode, pytest.mark.launcher]
STEPS = 3
RESTARTED_STEPS = 5
TIMEOUT_S = 240
SLOW_LINK = "tbf rate 4mbit burst 8kb latency 20ms"     # 4 Mbit/s, a 20 ms queue: bursts overflow it


def one_host_losses(pool, tmp_path, cfg):
    """The reference: the same job on one host's 4 ranks (the session's pool: its ranks are started)."""
    return jobs.losses(jobs.train_on_pool(pool, cfg, str(tmp_path / "one_host")))


def check_placed_by_host(run):
    """Each host runs 2 consecutive ranks (torchrun's c10d numbers the hosts in the order they join)."""
    hosts = jobs.read_json(os.path.join(run, "run.json"))["hosts"]
    placed = [(h["host"], h["addr"], h["local_world_size"]) for h in hosts]
    a, b = [("dsmn-a", "10.77.0.1", 2)] * 2, [("dsmn-b", "10.77.0.2", 2)] * 2
    assert placed in (a + b, b + a), placed


@needs("torchrun")
def test_zigzag_over_a_lossy_link_restarted_by_torchrun_equals_one_host(fresh, pool, tmp_path):
    """torchrun --max-restarts 1 on each host (c10d rendezvous) with --resume, over the shaped link: host
    b's ranks are killed after two steps, both hosts' ranks restart from the latest checkpoint, both
    torchruns exit 0, and the steps after the restart are the uninterrupted one-host run's, bit for bit."""
    hosts = fresh
    runs, saved = str(tmp_path / "runs"), str(tmp_path / "ckpt")
    # the restarted ranks of both hosts join within timeout_s of each other: on a loaded machine their
    # imports alone can take longer than a fault test's 20 s
    cfg = ["--deepspeed_config", jobs.ds_config(tmp_path, strategy="zigzag", size=4, timeout_s=TIMEOUT_S),
           "--steps", str(RESTARTED_STEPS), *jobs.TINY]
    for name in hosts.names:
        hosts.impair(name, SLOW_LINK)   # TCP retransmits what is dropped: slower, never different
    resumable = [*cfg, "--run_dir", runs, "--save_dir", saved, "--save_interval", "1", "--resume"]
    job = jobs.Job([jobs.torchrun_on(hosts, node, 29611, resumable, max_restarts=1) for node in (0, 1)], hosts.env())
    try:
        jobs.wait_for(lambda: jobs.steps_logged(runs) >= 2, TIMEOUT_S, "two logged steps")
        pids = jobs.rank_pids(runs)
        host_b = [r for r, pid in pids.items() if jobs.in_netns(pid, "dsmn-b")]
        assert sorted(pids) == [0, 1, 2, 3] and len(host_b) == 2, (pids, host_b)
        for r in host_b:
            os.kill(pids[r], signal.SIGKILL)
        # the uninterrupted reference trains while host a's ranks wait out their census of the lost ones
        # and torchrun restarts both hosts' ranks
        one_host = one_host_losses(pool, tmp_path, cfg)
        codes = job.wait(TIMEOUT_S)
    finally:
        job.close()
        dropped = sum(hosts.dropped(name) for name in hosts.names)
        for name in hosts.names:
            hosts.impair(name, "")
    out = job.output
    assert codes == [0, 0], f"torchrun exit codes {codes}\n{out[-6000:]}"
    assert dropped > 0, "the shaped link dropped nothing: the test did not exercise a lossy link"
    resumed = re.findall(r"resumed from \S+ at step (\d+)", out)
    assert resumed and len(set(resumed)) == 1, out[-6000:]
    first, restarted = sorted(os.listdir(runs))
    for run in (first, restarted):
        check_placed_by_host(os.path.join(runs, run))
    after = jobs.records(os.path.join(runs, restarted))
    step = int(resumed[0])
    assert [r["step"] for r in after] == list(range(step + 1, RESTARTED_STEPS + 1)), after
    assert [r["loss"] for r in after] == one_host[step:]


@needs("mpirun")
def test_hybrid_deepspeed_hostfile_openmpi_equals_one_host(fresh, pool, tmp_path):
    hosts = fresh
    cfg = ["--deepspeed_config", jobs.ds_config(tmp_path, strategy="zigzag", size=4, ulysses_size=2),
           "--steps", str(STEPS), *jobs.TINY]
    runs = str(tmp_path / "two_hosts")
    env = dict(hosts.env(), DS_ENV_FILE=os.path.join(str(tmp_path), ".deepspeed_env"))
    job = jobs.Job([jobs.deepspeed_hostfile(hosts, tmp_path, "openmpi", 29613, [*cfg, "--run_dir", runs])], env)
    try:
        assert job.wait(TIMEOUT_S) == [0], job.output[-4000:]
    finally:
        job.close()
    # Ulysses groups inside a host, the ring across: nothing to warn about
    assert "ulysses=2, ring=2" in job.output and "ds_seqpar.train: warning:" not in job.output, job.output[-4000:]
    check_placed_by_host(os.path.join(runs, os.listdir(runs)[0]))
    assert jobs.losses(runs) == one_host_losses(pool, tmp_path, cfg)
