"""4 hosts x 1 rank, started by mpirun with a hostfile from the head node (host a), its daemons
reached through ssh: a Hugging Face hybrid (Bamba: Mamba2 layers and attention) under Ulysses, its
Mamba2 layers' states passed by LASP, over the 4 hosts trains (warned: every all-to-all crosses the
network) and equals one host x 4 ranks step for step; a hostfile naming a host nobody can reach ends the
launch within seconds, naming that host."""
import os
import time

import pytest

from . import jobs
from .conftest import hosts_up, needs

pytestmark = [pytest.mark.multinode, pytest.mark.launcher]
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def four():
    yield from hosts_up(4)


@needs("mpirun")
def test_hf_hybrid_ulysses_lasp_mpirun_hostfile_on_four_hosts_equals_one_host(four, pool, tmp_path):
    cfg = ["--deepspeed_config", jobs.ds_config(tmp_path, strategy="ulysses", size=4, linear_strategy="lasp"),
           "--model", os.path.join(jobs.ROOT, "configs", "models", "bamba_small.json"), "--steps", "2", *jobs.TINY]
    runs = str(tmp_path / "four_hosts")
    job = jobs.Job([jobs.mpirun_hostfile(four, tmp_path, [*cfg, "--run_dir", runs])], four.env())
    try:
        assert job.wait(TIMEOUT_S) == [0], job.output[-4000:]
    finally:
        job.close()
    info = jobs.run_info(runs)
    assert info["model"]["model_type"] == "bamba", info["model"]
    assert info["ds_config"]["sequence_parallel"]["linear_strategy"] == "lasp", info["ds_config"]
    placed = [(h["host"], h["local_world_size"]) for h in info["hosts"]]
    assert placed == [(name, 1) for name in four.names], placed
    assert job.output.count("warning: sequence_parallel.size=4 puts all-to-all groups across hosts (ranks 0, 1, 2, "
                            "3 on dsmn-a, dsmn-b, dsmn-c, dsmn-d)") == 1, job.output[-4000:]
    assert jobs.losses(runs) == jobs.losses(jobs.train_on_pool(pool, cfg, str(tmp_path / "one_host")))


@needs("mpirun")
def test_a_hostfile_naming_an_unreachable_host_ends_the_launch_naming_it(four, tmp_path):
    cfg = ["--deepspeed_config", jobs.ds_config(tmp_path, strategy="ulysses", size=4), "--steps", "2", *jobs.TINY,
           "--run_dir", str(tmp_path / "runs")]
    start = time.time()
    job = jobs.Job([jobs.mpirun_hostfile(four, tmp_path, cfg, extra_hosts=["dsmn-z"])], four.env())
    try:
        codes = job.wait(60)
    finally:
        job.close()
    assert codes[0] not in (0, None) and time.time() - start < 60, (codes, job.output[-4000:])
    assert "dsmn-z" in job.output, job.output[-4000:]
