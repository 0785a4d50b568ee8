"""Exact across hosts: the main job's per-step losses at 2 hosts x 2 ranks equal one host x 4 ranks,
under torchrun on every host (zigzag, over a slow link that queues and drops packets: a `tc tbf`
token bucket on both hosts; this kernel has no `netem`) and under `deepspeed --hostfile` with pdsh (the 2D hybrid); run.json says
which host each rank ran on."""
import os

import pytest

from . import jobs
from .conftest import needs

pytestmark = [pytest.mark.multinode, pytest.mark.launcher]
STEPS = 3
TIMEOUT_S = 240
SLOW_LINK = "tbf rate 4mbit burst 8kb latency 20ms"     # 4 Mbit/s, a 20 ms queue: bursts overflow it


def one_host_losses(pool, tmp_path, cfg):
    """The reference: the same job on one host's 4 ranks (the session's pool: its ranks are started)."""
    return jobs.losses(jobs.train_on_pool(pool, cfg, str(tmp_path / "one_host")))


def check_placed_by_host(runs):
    placed = [(h["host"], h["addr"], h["local_world_size"]) for h in jobs.run_info(runs)["hosts"]]
    assert placed == [("dsmn-a", "10.77.0.1", 2)] * 2 + [("dsmn-b", "10.77.0.2", 2)] * 2, placed


@needs("torchrun")
def test_zigzag_torchrun_on_each_host_equals_one_host(fresh, pool, tmp_path):
    hosts = fresh
    cfg = ["--deepspeed_config", jobs.ds_config(tmp_path, strategy="zigzag", size=4), "--steps", str(STEPS),
           *jobs.TINY]
    runs = str(tmp_path / "two_hosts")
    for name in hosts.names:
        hosts.impair(name, SLOW_LINK)   # TCP retransmits what is dropped: slower, never different
    job = jobs.Job([jobs.torchrun_on(hosts, node, 29611, [*cfg, "--run_dir", runs]) for node in (0, 1)],
                   hosts.env())
    try:
        assert job.wait(TIMEOUT_S) == [0, 0], job.output[-4000:]
    finally:
        job.close()
    dropped = sum(hosts.dropped(name) for name in hosts.names)
    for name in hosts.names:
        hosts.impair(name, "")
    assert dropped > 0, "the shaped link dropped nothing: the test did not exercise a lossy link"
    check_placed_by_host(runs)
    assert jobs.losses(runs) == one_host_losses(pool, tmp_path, cfg)


@needs("pdsh")
def test_hybrid_deepspeed_hostfile_pdsh_equals_one_host(fresh, pool, tmp_path):
    hosts = fresh
    cfg = ["--deepspeed_config", jobs.ds_config(tmp_path, strategy="zigzag", size=4, ulysses_size=2),
           "--steps", str(STEPS), *jobs.TINY]
    runs = str(tmp_path / "two_hosts")
    env = dict(hosts.env(), DS_ENV_FILE=os.path.join(str(tmp_path), ".deepspeed_env"))
    job = jobs.Job([jobs.deepspeed_hostfile(hosts, tmp_path, "pdsh", 29613, [*cfg, "--run_dir", runs])], env)
    try:
        assert job.wait(TIMEOUT_S) == [0], job.output[-4000:]
    finally:
        job.close()
    # Ulysses groups inside a host, the ring across: nothing to warn about
    assert "ulysses=2, ring=2" in job.output and "ds_seqpar.train: warning:" not in job.output, job.output[-4000:]
    check_placed_by_host(runs)
    assert jobs.losses(runs) == one_host_losses(pool, tmp_path, cfg)
