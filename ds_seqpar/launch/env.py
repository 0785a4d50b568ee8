"""Who started this process, and the env:// block torch.distributed (and DeepSpeed) read to join.

Every launcher says a process's place in the job in its own variables; ``launch_env`` reads them
and returns one consistent RANK / LOCAL_RANK / WORLD_SIZE / LOCAL_WORLD_SIZE / MASTER_ADDR /
MASTER_PORT block, set before DeepSpeed initialises (with all five of its variables present,
DeepSpeed runs no MPI discovery of its own). Readers, first match wins:

  env://     RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR set: torchrun, the deepspeed launcher,
             ``spawn_local``, or by hand. First, because torchrun or deepspeed started by srun or
             mpirun inherit that launcher's variables too, and theirs describe the node, not the rank.
  openmpi    OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE} (mpirun / mpiexec of Open MPI)
  mvapich    MV2_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}
  mpich      PMI_RANK, PMI_SIZE with MPI_LOCALRANKID / MPI_LOCALNRANKS (MPICH and Intel MPI Hydra),
             PMI_LOCAL_RANK (Cray PMI) or PALS_LOCAL_RANKID (Cray PALS)
  slurm      SLURM_PROCID, SLURM_LOCALID, SLURM_STEP_NUM_TASKS: a task started by srun (the batch
             script itself has no step task count and is not a rank). After the MPI readers: an
             MPI launcher started inside an allocation inherits the allocation's SLURM_* values.

The local rank always comes from the launcher, never from the global rank: Open MPI maps ranks
by package, so with more ranks than cores rank 1 may be local rank 2, and the CUDA device a rank
takes must be the one its launcher meant. MASTER_ADDR is 127.0.0.1 when the launcher says all
ranks share this node; under Slurm it is the first host of the step's node list (rank 0's under
srun's block or cyclic distribution); under an MPI launcher on several nodes no variable names
rank 0's host, so rank 0 broadcasts its host name once over MPI (``mpi_rank0_host``). An env
MASTER_ADDR / MASTER_PORT always wins; the port is otherwise ``--master_port``, the same argv on
every rank. A launcher whose variables are incomplete or contradict each other is refused with
the variables named, before any communication.
"""
from __future__ import annotations

import dataclasses
import os
import re
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Mapping, Optional

from ..config import ConfigError

LOOPBACK = "127.0.0.1"
# rank variables of launchers no reader knows (prterun, Cray PALS alone): seeing one is an error,
# not "no launcher", or every rank would start a job of its own
FOREIGN_RANK_VARS = ("PMIX_RANK", "PALS_RANKID")


class LaunchError(ConfigError):
    """The launcher's variables are incomplete or inconsistent; the message names them."""


@contextmanager
def restored_environ(*names: str) -> Iterator[None]:
    """Inside: change these environment variables freely; on exit each is back as it was (unset
    if it was unset). Child processes started inside see the changes."""
    saved = {k: os.environ.get(k) for k in names}
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def free_port() -> int:
    """A TCP port nobody listens on right now (the master's rendezvous port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int, local_rank: Optional[int] = None,
             local_world_size: Optional[int] = None, master_addr: str = LOOPBACK) -> Dict[str, str]:
    """The env:// block of one rank; on one machine the local rank is the global one."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank if local_rank is None else local_rank),
            "LOCAL_WORLD_SIZE": str(world_size if local_world_size is None else local_world_size),
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(port)}


@dataclass(frozen=True)
class Launch:
    """One process's place in the job, as its launcher gave it."""
    launcher: str                      # env, openmpi, mvapich, mpich, slurm, or none (one process)
    rank: int
    world_size: int
    local_rank: int
    local_world_size: Optional[int]    # None where the launcher does not say (only Slurm, uneven nodes)
    master_addr: Optional[str]         # None: several nodes under MPI, rank 0 must tell its host
    master_port: int
    source: str                        # the variable the local rank came from, for messages

    def env(self) -> Dict[str, str]:
        if self.master_addr is None:
            raise LaunchError(f"{self.launcher}: MASTER_ADDR is not known yet (rank 0's host must be asked first)")
        block = rank_env(self.rank, self.world_size, self.master_port, self.local_rank,
                         self.local_world_size, self.master_addr)
        if self.local_world_size is None:
            del block["LOCAL_WORLD_SIZE"]
        return block


# ---------------------------------------------------------------------------------------------
# reading the environment (pure: a mapping in, a Launch out)


def _int(env: Mapping[str, str], *names: str) -> Optional[int]:
    """The first of ``names`` that is set, as an int; None if none is set."""
    for name in names:
        if name in env:
            try:
                return int(env[name])
            except ValueError:
                raise LaunchError(f"{name}={env[name]!r} is not an integer") from None
    return None


def _need(env: Mapping[str, str], launcher: str, *names: str) -> int:
    value = _int(env, *names)
    if value is None:
        raise LaunchError(f"{launcher} launch: {' or '.join(names)} is not set; "
                          f"set RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT yourself")
    return value


def _port(env: Mapping[str, str], default_port: int) -> int:
    port = _int(env, "MASTER_PORT")
    return default_port if port is None else port


def _master(env: Mapping[str, str], one_node: bool) -> Optional[str]:
    return env.get("MASTER_ADDR") or (LOOPBACK if one_node else None)


def _read_env_vars(env, default_port):
    if "RANK" not in env:
        return None
    world = _need(env, "env://", "WORLD_SIZE")
    local = _need(env, "env://", "LOCAL_RANK")
    # torchrun says LOCAL_WORLD_SIZE, the deepspeed launcher LOCAL_SIZE
    local_world = _int(env, "LOCAL_WORLD_SIZE", "LOCAL_SIZE")
    master = _master(env, one_node=world == 1 or local_world == world)
    if master is None:
        raise LaunchError(f"env:// launch: RANK={env['RANK']} and WORLD_SIZE={world} are set but MASTER_ADDR is "
                          f"not; set it to rank 0's host")
    return Launch("env", _need(env, "env://", "RANK"), world, local, local_world, master,
                  _port(env, default_port), "LOCAL_RANK")


def _read_world_vars(prefix: str, launcher: str):
    """Open MPI and MVAPICH name the same four facts with their own prefix."""
    def read(env, default_port):
        if f"{prefix}_RANK" not in env:
            return None
        world, local_world = (_need(env, launcher, f"{prefix}_{k}") for k in ("SIZE", "LOCAL_SIZE"))
        return Launch(launcher, _need(env, launcher, f"{prefix}_RANK"), world,
                      _need(env, launcher, f"{prefix}_LOCAL_RANK"), local_world,
                      _master(env, local_world == world), _port(env, default_port), f"{prefix}_LOCAL_RANK")
    return read


def _read_pmi(env, default_port):
    if "PMI_RANK" not in env:
        return None
    rank, world = _need(env, "mpich", "PMI_RANK"), _need(env, "mpich", "PMI_SIZE")
    source = next((v for v in ("MPI_LOCALRANKID", "PMI_LOCAL_RANK", "PALS_LOCAL_RANKID") if v in env), None)
    if source is None:
        # srun --mpi=pmi2 sets PMI_RANK but no local rank: Slurm's own variables have it
        if _int(env, "SLURM_PROCID") == rank and "SLURM_STEP_NUM_TASKS" in env:
            return _read_slurm(env, default_port)
        raise LaunchError(f"mpich launch: PMI_RANK={rank} is set but no local rank (MPI_LOCALRANKID, "
                          f"PMI_LOCAL_RANK or PALS_LOCAL_RANKID); set LOCAL_RANK, RANK, WORLD_SIZE, "
                          f"MASTER_ADDR and MASTER_PORT yourself")
    local_world = _int(env, "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE", "PALS_LOCAL_SIZE")
    return Launch("mpich", rank, world, _int(env, source), local_world, _master(env, local_world == world),
                  _port(env, default_port), source)


def _read_slurm(env, default_port):
    if "SLURM_PROCID" not in env or "SLURM_STEP_NUM_TASKS" not in env:
        return None
    world = _need(env, "slurm", "SLURM_STEP_NUM_TASKS")     # this step's tasks, not the allocation's
    nodes = _int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES")
    local_world = world if nodes == 1 else slurm_tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE", ""),
                                                               _int(env, "SLURM_NODEID"))
    master = _master(env, nodes == 1)
    if master is None:
        nodelist = next((env[v] for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                         if env.get(v)), None)
        if nodelist is None:
            raise LaunchError("slurm launch on several nodes: SLURM_STEP_NODELIST is not set, so rank 0's host "
                              "is unknown; set MASTER_ADDR")
        master = first_host(nodelist)
    return Launch("slurm", _need(env, "slurm", "SLURM_PROCID"), world, _need(env, "slurm", "SLURM_LOCALID"),
                  local_world, master, _port(env, default_port), "SLURM_LOCALID")


# (name, reader) in the order they are tried; a reader returns None when its launcher is absent
READERS = (("env", _read_env_vars), ("openmpi", _read_world_vars("OMPI_COMM_WORLD", "openmpi")),
           ("mvapich", _read_world_vars("MV2_COMM_WORLD", "mvapich")), ("mpich", _read_pmi),
           ("slurm", _read_slurm))


def detect(env: Mapping[str, str], default_port: int = 29500) -> Optional[Launch]:
    """The launcher that started this process, or None if none did. Raises LaunchError when a
    launcher's variables are incomplete or out of range."""
    for _, read in READERS:
        launch = read(env, default_port)
        if launch is not None:
            _check_ranges(launch)
            return launch
    foreign = [v for v in FOREIGN_RANK_VARS if v in env]
    if foreign:
        seen = ", ".join(f"{v}={env[v]}" for v in foreign)
        raise LaunchError(f"started by a launcher ds_seqpar cannot read ({seen}); set RANK, LOCAL_RANK, "
                          f"WORLD_SIZE, MASTER_ADDR and MASTER_PORT for each rank")
    return None


def _check_ranges(launch: Launch) -> None:
    lw = launch.local_world_size
    bad = []
    if not 0 <= launch.rank < launch.world_size:
        bad.append(f"rank {launch.rank} is not in [0, world size {launch.world_size})")
    if launch.local_rank < 0 or (lw is not None and not launch.local_rank < lw <= launch.world_size):
        bad.append(f"local rank {launch.local_rank} ({launch.source}) with {lw} ranks on this node "
                   f"of {launch.world_size}")
    if bad:
        raise LaunchError(f"{launch.launcher} launch: " + "; ".join(bad))


def under_launcher(env: Mapping[str, str]) -> bool:
    """True if a launcher started this process (it is one rank of a job), False if a person did."""
    return detect(env) is not None


# ---------------------------------------------------------------------------------------------
# Slurm's compressed host lists and task counts


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: 'gpu[07-09,12],cpu1' -> 'gpu07', 'r[1-2]-n[3,5]' -> 'r1-n3'."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            end = i
            break
    # in each bracket group the first item's first value, zero padding kept
    host = re.sub(r"\[([^\]\-,]+)[^\]]*\]", r"\1", nodelist[:end].strip())
    if not host or any(c in host for c in "[],"):
        raise LaunchError(f"cannot read the Slurm host list {nodelist!r}; set MASTER_ADDR to rank 0's host")
    return host


def slurm_tasks_on_node(tasks_per_node: str, node_index: Optional[int]) -> Optional[int]:
    """Tasks on node ``node_index`` from SLURM_STEP_TASKS_PER_NODE ('4(x2),3' = 4, 4, 3); None if unknown."""
    counts = []
    for part in filter(None, tasks_per_node.split(",")):
        found = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if found is None:
            return None
        counts += [int(found.group(1))] * int(found.group(2) or 1)
    if len(set(counts)) == 1:
        return counts[0]
    return counts[node_index] if node_index is not None and 0 <= node_index < len(counts) else None


# ---------------------------------------------------------------------------------------------
# the block to set before deepspeed.init_distributed, and the device


def mpi_rank0_host() -> str:
    """Rank 0's host name, told to every rank over MPI (several nodes under an MPI launcher).

    MPI lives only for this one broadcast: it is finalized right after, by every rank at the same
    point, so no rank is later held in MPI_Finalize at exit waiting for a peer that failed."""
    from mpi4py import MPI
    host = MPI.COMM_WORLD.bcast(socket.gethostname(), root=0)
    MPI.Finalize()
    return host


def launch_env(env: Mapping[str, str], default_port: int = 29500, local_rank_arg: Optional[int] = None,
               rank0_host: Callable[[], str] = mpi_rank0_host) -> Dict[str, str]:
    """The env:// block for this process: from its launcher, or a world of one without one."""
    launch = detect(env, default_port) or Launch("none", 0, 1, 0, 1, LOOPBACK, _port(env, default_port), "-")
    if local_rank_arg is not None and local_rank_arg >= 0 and local_rank_arg != launch.local_rank:
        raise LaunchError(f"--local_rank={local_rank_arg} disagrees with {launch.source}={launch.local_rank} "
                          f"({launch.launcher} launch)")
    ompi_local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
    if ompi_local is not None and ompi_local != launch.local_rank:
        # DeepSpeed's engine asserts these agree: say which variable is wrong before it does
        raise LaunchError(f"{launch.source}={launch.local_rank} disagrees with Open MPI's "
                          f"OMPI_COMM_WORLD_LOCAL_RANK={ompi_local}; do not pass LOCAL_RANK to mpirun (-x)")
    if launch.master_addr is None:
        launch = dataclasses.replace(launch, master_addr=rank0_host())
    return launch.env()


def cuda_device(local_rank: int, local_world_size: Optional[int], device_count: int) -> int:
    """The CUDA device of this rank: its launcher's local rank, or 0 when the launcher gave each
    rank exactly one visible device (srun --gpus-per-task=1, per-rank CUDA_VISIBLE_DEVICES)."""
    if device_count == 1:
        return 0
    if local_rank >= device_count or (local_world_size or 0) > device_count:
        raise LaunchError(f"{local_world_size or local_rank + 1} ranks on this node but {device_count} visible CUDA "
                          f"devices (local rank {local_rank}); start at most {device_count} ranks per node, or "
                          f"give each rank one device through CUDA_VISIBLE_DEVICES")
    return local_rank


def local_device(env: Mapping[str, str], device_count: int) -> int:
    """``cuda_device`` of the rank whose env:// block (``launch_env``'s) is ``env``."""
    local_world = env.get("LOCAL_WORLD_SIZE")
    return cuda_device(int(env.get("LOCAL_RANK", 0)), int(local_world) if local_world else None, device_count)


__all__ = ["Launch", "LaunchError", "READERS", "cuda_device", "detect", "first_host", "free_port",
           "launch_env", "local_device", "mpi_rank0_host", "rank_env", "slurm_tasks_on_node", "under_launcher"]
