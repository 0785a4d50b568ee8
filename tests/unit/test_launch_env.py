"""Each launcher's environment -> one consistent env:// block (launch/env.py), without processes.

The Open MPI and torchrun environments are the variables those launchers set on this machine
(mpirun 5.0 maps ranks by package, so local ranks are not the global ones once ranks outnumber
cores); Slurm and the deepspeed multi-node launcher are built from the shipped scripts'
own settings (launchers/slurm.sbatch, launchers/deepspeed_multi_node.sh + hostfile.example)."""
import os
import re

import pytest

from ds_seqpar.launch.env import (LaunchError, cuda_device, detect, first_host, launch_env, local_device,
                                  slurm_tasks_on_node, under_launcher)
from ds_seqpar.topology import ParallelDims

LAUNCHERS = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "launchers")
PORT = 29555


def no_mpi():
    raise AssertionError("asked rank 0's host over MPI on a single node")


def openmpi(rank, local, size, local_size, **extra):
    """What mpirun -np N sets (measured: Open MPI 5.0.11), plus the PMIx twins it sets too."""
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(local), "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
            "OMPI_COMM_WORLD_NODE_RANK": str(local), "OMPI_UNIVERSE_SIZE": "2", "PMIX_RANK": str(rank),
            "PMIX_HOSTNAME": "vm", "PRTE_LAUNCHED": "1", **extra}


def check_world(envs, hosts, **kw):
    """The blocks of a whole job: ranks 0..W-1 once each, one world size and rendezvous, and on
    every host the local ranks 0..n-1 once each (one device per rank)."""
    blocks = [launch_env(e, PORT, rank0_host=kw.get("rank0_host", no_mpi)) for e in envs]
    assert sorted(int(b["RANK"]) for b in blocks) == list(range(len(envs))), blocks
    assert {b["WORLD_SIZE"] for b in blocks} == {str(len(envs))}
    assert len({(b["MASTER_ADDR"], b["MASTER_PORT"]) for b in blocks}) == 1, blocks
    for host in set(hosts):
        mine = [b for b, h in zip(blocks, hosts) if h == host]
        assert sorted(int(b["LOCAL_RANK"]) for b in mine) == list(range(len(mine))), (host, mine)
        assert all(b.get("LOCAL_WORLD_SIZE", str(len(mine))) == str(len(mine)) for b in mine), mine
    # what DeepSpeed's engine asserts under Open MPI
    for e, b in zip(envs, blocks):
        if "OMPI_COMM_WORLD_LOCAL_RANK" in e:
            assert b["LOCAL_RANK"] == e["OMPI_COMM_WORLD_LOCAL_RANK"], (e, b)
    return blocks


# ---------------------------------------------------------------------------------------------
# MPI launchers


@pytest.mark.parametrize("local_of_rank", [[0, 2, 1, 3], [0, 2, 4, 6, 1, 3, 5, 7], [0, 1]],
                         ids=["np4-oversubscribed", "np8-oversubscribed", "np2"])
def test_openmpi_local_rank_is_open_mpis_not_the_global_rank(local_of_rank):
    n = len(local_of_rank)
    envs = [openmpi(r, local, n, n) for r, local in enumerate(local_of_rank)]
    blocks = check_world(envs, ["vm"] * n)
    assert [int(b["LOCAL_RANK"]) for b in blocks] == local_of_rank
    assert blocks[1] == {"RANK": "1", "WORLD_SIZE": str(n), "LOCAL_RANK": str(local_of_rank[1]),
                         "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(PORT)}
    assert detect(envs[0]).launcher == "openmpi"


def test_openmpi_on_two_nodes_asks_rank_0_once_unless_master_addr_is_given():
    hosts = ["a"] * 4 + ["b"] * 4
    envs = [openmpi(r, r % 4, 8, 4) for r in range(8)]
    asked = []
    blocks = check_world(envs, hosts, rank0_host=lambda: asked.append(1) or "a")
    assert {b["MASTER_ADDR"] for b in blocks} == {"a"} and len(asked) == 8      # once per rank
    given = check_world([dict(e, MASTER_ADDR="head", MASTER_PORT="4000") for e in envs], hosts)
    assert {(b["MASTER_ADDR"], b["MASTER_PORT"]) for b in given} == {("head", "4000")}


def test_mvapich():
    envs = [{"MV2_COMM_WORLD_RANK": str(r), "MV2_COMM_WORLD_SIZE": "4", "MV2_COMM_WORLD_LOCAL_RANK": str(r % 2),
             "MV2_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "n0"} for r in range(4)]
    check_world(envs, ["n0", "n0", "n1", "n1"])
    assert detect(envs[3]).launcher == "mvapich"


@pytest.mark.parametrize("local_vars", [("MPI_LOCALRANKID", "MPI_LOCALNRANKS"), ("PMI_LOCAL_RANK", "PMI_LOCAL_SIZE"),
                                        ("PALS_LOCAL_RANKID", "PALS_LOCAL_SIZE")],
                         ids=["mpich-intel-hydra", "cray-pmi", "cray-pals"])
def test_mpich_family_one_and_two_nodes(local_vars):
    local, local_size = local_vars
    one = [{"PMI_RANK": str(r), "PMI_SIZE": "3", local: str(r), local_size: "3"} for r in range(3)]
    assert {b["MASTER_ADDR"] for b in check_world(one, ["x"] * 3)} == {"127.0.0.1"}
    # Hydra started by srun inside an allocation: the proxies' SLURM_* describe nodes, not ranks
    two = [{"PMI_RANK": str(r), "PMI_SIZE": "4", local: str(r % 2), local_size: "2", "SLURM_PROCID": str(r // 2),
            "SLURM_LOCALID": "0", "SLURM_STEP_NUM_TASKS": "2"} for r in range(4)]
    check_world(two, ["x", "x", "y", "y"], rank0_host=lambda: "x")
    assert detect(two[1]).launcher == "mpich" and detect(two[1]).source == local


def test_srun_pmi2_takes_the_local_rank_from_slurm():
    env = {"PMI_RANK": "5", "PMI_SIZE": "8", **slurm_task(5, 4, 2, "g[1-2]")}
    launch = detect(env)
    assert (launch.launcher, launch.rank, launch.local_rank, launch.master_addr) == ("slurm", 5, 1, "g1")


def test_pmi_without_any_local_rank_is_refused():
    with pytest.raises(LaunchError, match="PMI_RANK=1 is set but no local rank .*MPI_LOCALRANKID"):
        detect({"PMI_RANK": "1", "PMI_SIZE": "2"})


# ---------------------------------------------------------------------------------------------
# Slurm, from launchers/slurm.sbatch


def slurm_task(rank, per_node, nodes, nodelist, **extra):
    """What srun sets for one task of a block-distributed step (plus the allocation's job vars)."""
    return {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": nodelist, "SLURM_NNODES": str(nodes),
            "SLURM_NTASKS": str(per_node * nodes), "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % per_node),
            "SLURM_NODEID": str(rank // per_node), "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": str(per_node * nodes),
            "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_STEP_NODELIST": nodelist,
            "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{nodes})" if nodes > 1 else str(per_node), **extra}


def sbatch_settings(path):
    with open(path) as f:
        text = f.read()
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))
    # the srun command with its continuation lines
    command = re.search(r"^srun .*?[^\\]$", text, re.M | re.S).group(0)
    return directives, command.replace("\\\n", " ")


def test_slurm_sbatch_script_gives_every_task_its_place_and_one_rendezvous():
    directives, srun = sbatch_settings(os.path.join(LAUNCHERS, "slurm.sbatch"))
    nodes, per_node = int(directives["nodes"]), int(directives["ntasks-per-node"])
    assert per_node == int(directives["gpus-per-node"]), "one task per GPU: the local rank is the device"
    assert "--kill-on-bad-exit=1" in srun, "one failed task must end the step"
    sp_size = int(re.search(r"--sp_size (\d+)", srun).group(1))
    envs = [slurm_task(r, per_node, nodes, "gnode[10,20]") for r in range(nodes * per_node)]
    hosts = [f"gnode{10 * (1 + r // per_node)}" for r in range(nodes * per_node)]
    blocks = check_world(envs, hosts)
    assert {b["MASTER_ADDR"] for b in blocks} == {"gnode10"}      # rank 0's node, no MPI, no scontrol
    assert {cuda_device(int(b["LOCAL_RANK"]), per_node, per_node) for b in blocks} == set(range(per_node))
    # each sequence-parallel group on one node (its all-to-all and ring stay on the fast links)
    for group in ParallelDims(nodes * per_node, sp_size, 1).sp_group_ranks():
        assert len({hosts[r] for r in group}) == 1, group


def test_slurm_batch_script_itself_is_not_a_rank_and_an_mpi_launch_inside_slurm_is_mpis():
    batch = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "16",
             "SLURM_JOB_NODELIST": "g[1-2]"}
    assert not under_launcher(batch)
    launch = detect(dict(batch, **openmpi(3, 1, 16, 8)))
    assert (launch.launcher, launch.rank, launch.local_rank) == ("openmpi", 3, 1)


def test_slurm_one_node_uses_loopback_and_uneven_nodes_count_their_own_tasks():
    assert detect(slurm_task(1, 4, 1, "g7")).master_addr == "127.0.0.1"
    env = dict(slurm_task(9, 4, 3, "g[1-3]"), SLURM_STEP_TASKS_PER_NODE="4(x2),2", SLURM_LOCALID="1")
    assert detect(env).local_world_size == 2


# ---------------------------------------------------------------------------------------------
# torchrun and the deepspeed launcher


def torchrun(rank, local, world, local_world, **extra):
    """What torchrun --nproc_per_node sets (measured)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(local_world),
            "GROUP_RANK": str(rank // local_world), "ROLE_RANK": str(rank), "MASTER_ADDR": "localhost",
            "MASTER_PORT": "41111", "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0", **extra}


def test_torchrun_and_torchrun_under_srun_use_torchruns_variables():
    blocks = check_world([torchrun(r, r, 4, 4) for r in range(4)], ["vm"] * 4)
    assert (blocks[0]["MASTER_ADDR"], blocks[0]["MASTER_PORT"]) == ("localhost", "41111")
    # srun starts one torchrun per node; its workers inherit the node's SLURM_PROCID / SLURM_LOCALID
    envs = [torchrun(r, r % 4, 8, 4, **slurm_task(r // 4, 1, 2, "g[1-2]")) for r in range(8)]
    check_world(envs, ["g1"] * 4 + ["g2"] * 4)


def deepspeed_launch_envs(hostfile):
    """The env DeepSpeed's launcher gives each rank for a hostfile (consecutive ranks per node,
    local rank = rank modulo the node's slots, the first host as master, --local_rank in argv)."""
    with open(hostfile) as f:
        slots = [(line.split()[0], int(line.split("slots=")[1])) for line in f
                 if line.strip() and not line.startswith("#")]
    world, envs, hosts = sum(n for _, n in slots), [], []
    for node, (host, n) in enumerate(slots):
        for local in range(n):
            envs.append({"RANK": str(len(envs)), "LOCAL_RANK": str(local), "WORLD_SIZE": str(world),
                         "LOCAL_SIZE": str(n), "CROSS_RANK": str(node), "CROSS_SIZE": str(len(slots)),
                         "MASTER_ADDR": slots[0][0], "MASTER_PORT": "29500"})
            hosts.append(host)
    return envs, hosts


def test_deepspeed_multi_node_script_and_hostfile():
    envs, hosts = deepspeed_launch_envs(os.path.join(LAUNCHERS, "hostfile.example"))
    blocks = check_world(envs, hosts)
    assert {b["MASTER_ADDR"] for b in blocks} == {hosts[0]}
    assert all(launch_env(e, PORT, local_rank_arg=int(e["LOCAL_RANK"])) for e in envs)   # --local_rank=N agrees
    with open(os.path.join(LAUNCHERS, "deepspeed_multi_node.sh")) as f:
        sp_size = int(re.search(r"--sp_size (\d+)", f.read()).group(1))
    for group in ParallelDims(len(envs), sp_size, 1).sp_group_ranks():
        assert len({hosts[r] for r in group}) == 1, group


def test_a_block_read_back_is_the_same_world():
    """After main sets the block, a second look (DeepSpeed's, or ours in a child) sees the same."""
    for env in (openmpi(1, 2, 4, 4), slurm_task(5, 4, 2, "g[1-2]"), torchrun(3, 3, 4, 4)):
        block = launch_env(env, PORT, rank0_host=no_mpi)
        assert launch_env({**env, **block}, PORT, rank0_host=no_mpi) == block


def test_no_launcher_is_a_world_of_one():
    assert not under_launcher({})
    assert launch_env({}, PORT) == {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(PORT)}


# ---------------------------------------------------------------------------------------------
# refused before any communication, with the variables named


@pytest.mark.parametrize("env,message", [
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "LOCAL_RANK is not set"),
    ({"RANK": "1", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, "MASTER_ADDR is not"),
    ({"RANK": "4", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "h"}, r"rank 4 is not in \[0, world size 4\)"),
    ({"RANK": "x", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "h"}, "RANK='x' is not an integer"),
    (openmpi(1, 4, 8, 4), r"local rank 4 \(OMPI_COMM_WORLD_LOCAL_RANK\) with 4 ranks on this node"),
    (dict(openmpi(1, 2, 4, 4), RANK="1", WORLD_SIZE="4", LOCAL_RANK="1", MASTER_ADDR="h"),
     "LOCAL_RANK=1 disagrees with Open MPI's OMPI_COMM_WORLD_LOCAL_RANK=2"),
    ({"PMIX_RANK": "0"}, "cannot read .*PMIX_RANK=0.*set RANK, LOCAL_RANK"),
    (dict(slurm_task(0, 2, 2, "g[1-2]"), SLURM_STEP_NODELIST="", SLURM_JOB_NODELIST=""), "set MASTER_ADDR"),
], ids=["no-local-rank", "no-master", "rank-range", "not-int", "local-range", "deepspeed-would-assert",
        "unknown-launcher", "slurm-no-nodelist"])
def test_inconsistent_launch_is_refused(env, message):
    with pytest.raises(LaunchError, match=message):
        launch_env(env, PORT, rank0_host=no_mpi)


def test_local_rank_argument_must_agree():
    with pytest.raises(LaunchError, match="--local_rank=0 disagrees with LOCAL_RANK=1"):
        launch_env(torchrun(1, 1, 2, 2), PORT, local_rank_arg=0)


# ---------------------------------------------------------------------------------------------
# host lists, task counts, devices


@pytest.mark.parametrize("nodelist,first", [("gnode[10,20]", "gnode10"), ("gpu[07-09,12],cpu1", "gpu07"),
                                            ("r[1-2]-n[3,5]", "r1-n3"), ("solo", "solo"), ("a1,b[2-3]", "a1"),
                                            ("node[001-128]", "node001")])
def test_first_host_of_a_slurm_host_list(nodelist, first):
    assert first_host(nodelist) == first


def test_slurm_tasks_on_node():
    assert slurm_tasks_on_node("8(x2)", 1) == 8
    assert [slurm_tasks_on_node("4(x2),3", i) for i in range(3)] == [4, 4, 3]
    assert slurm_tasks_on_node("4(x2),3", None) is None and slurm_tasks_on_node("", 0) is None


def test_cuda_device_is_the_launchers_local_rank():
    assert [cuda_device(r, 8, 8) for r in (0, 3, 7)] == [0, 3, 7]
    assert cuda_device(5, 8, 1) == 0            # the launcher left one visible device per rank
    with pytest.raises(LaunchError, match="8 ranks on this node but 4 visible CUDA devices"):
        cuda_device(1, 8, 4)                     # every rank refuses, not only ranks 4..7
    # from the block set under mpirun -np 4 on this machine: rank 1 is local rank 2, so device 2
    assert local_device(launch_env(openmpi(1, 2, 4, 4), PORT), 4) == 2
