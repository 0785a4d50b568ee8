"""World -> (data, ring, ulysses) coordinates, the process groups built from them, and the mpu.

Rank order (the innermost dimension varies fastest, so it lands on neighbouring ranks, i.e. on
one node, where all-to-all bandwidth is highest):

    rank = dp_rank * sp_size + ring_rank * ulysses_size + ulysses_rank
    sp_rank = ring_rank * ulysses_size + ulysses_rank

world=8, sp=4 (ulysses=2 x ring=2), dp=2:

    rank      0 1 2 3 | 4 5 6 7
    dp_rank   0 0 0 0 | 1 1 1 1
    ring      0 0 1 1 | 0 0 1 1
    ulysses   0 1 0 1 | 0 1 0 1

Everything above the ``ProcessGroups`` class is pure arithmetic taking (world_size, rank) as
arguments, unit-tested without processes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Sequence

from . import comm
from .config import check_sizes


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    sp_size: int
    ulysses_size: int = 1

    def __post_init__(self):
        check_sizes(self.world_size, self.sp_size, self.ulysses_size)      # ConfigError, a ValueError

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    @property
    def ring_size(self) -> int:
        return self.sp_size // self.ulysses_size

    def coords(self, rank: int) -> "Coords":
        sp_rank = rank % self.sp_size
        return Coords(rank=rank, dp_rank=rank // self.sp_size, sp_rank=sp_rank,
                      ring_rank=sp_rank // self.ulysses_size, ulysses_rank=sp_rank % self.ulysses_size)

    def sp_group_ranks(self) -> List[List[int]]:
        """One sequence group per data-parallel replica: consecutive blocks of sp_size ranks."""
        return [list(range(d * self.sp_size, (d + 1) * self.sp_size)) for d in range(self.dp_size)]

    def dp_group_ranks(self) -> List[List[int]]:
        """Ranks holding the same tokens in different replicas: stride sp_size."""
        return [list(range(s, self.world_size, self.sp_size)) for s in range(self.sp_size)]

    def ulysses_group_ranks(self) -> List[List[int]]:
        u = self.ulysses_size
        return [list(range(start, start + u)) for start in range(0, self.world_size, u)]

    def ring_group_ranks(self) -> List[List[int]]:
        """Same ulysses position, consecutive ring positions, within one sequence group."""
        groups = []
        for sp_ranks in self.sp_group_ranks():
            for u in range(self.ulysses_size):
                groups.append(sp_ranks[u::self.ulysses_size])
        return groups


@dataclass(frozen=True)
class Coords:
    rank: int
    dp_rank: int
    sp_rank: int
    ring_rank: int
    ulysses_rank: int


def ulysses_degree(size: int, ulysses_size: int) -> int:
    """The all-to-all degree a group of ``size`` ranks runs with: ``ulysses_size`` where it divides
    the size, else 1 (the ring strategy alone). Dynamic groups (schedule/family.py) are built by it
    and priced by it (cost/documents.py)."""
    return ulysses_size if size % ulysses_size == 0 else 1


def placement_problems(dims: ParallelDims, hosts: Sequence[Mapping],
                       key: str = "sequence_parallel.ulysses_size") -> List[str]:
    """What is wrong with where the ranks run, from every rank's host as gathered at start
    (launch/hosts.py: ``host`` and the launcher's ``local_world_size``, None when it set none).

    The rank order above puts each Ulysses group on consecutive ranks, which launchers place on
    one host (torchrun, deepspeed, mpirun's default by-slot mapping, Slurm's block distribution);
    the ring then crosses hosts. Said here: a launcher whose local world disagrees with the host
    names (its local ranks would pick the wrong devices), and Ulysses groups spanning hosts
    (correct, but each all-to-all then crosses the slower link: ulysses_size is too large for
    the ranks of one host, or the launcher did not place ranks by host)."""
    on_host: Dict[str, List[int]] = {}
    for rank, h in enumerate(hosts):
        on_host.setdefault(h["host"], []).append(rank)
    problems = [f"rank {r}: the launcher says {h['local_world_size']} ranks share its host {h['host']!r}, "
                f"but {len(on_host[h['host']])} do (ranks {', '.join(map(str, on_host[h['host']]))})"
                for r, h in enumerate(hosts)
                if h.get("local_world_size") is not None and h["local_world_size"] != len(on_host[h["host"]])]
    spanning = [g for g in dims.ulysses_group_ranks() if len({hosts[r]["host"] for r in g}) > 1]
    if spanning:
        fewest = min(len(ranks) for ranks in on_host.values())
        problems.append(
            f"{key}={dims.ulysses_size} puts all-to-all groups across hosts (ranks "
            f"{', '.join(map(str, spanning[0]))} on {', '.join(sorted({hosts[r]['host'] for r in spanning[0]}))}): "
            f"every all-to-all crosses the network. With {fewest} rank(s) per host, ulysses_size dividing "
            f"{fewest} (a ring strategy) keeps them inside a host and puts the ring across hosts")
    return problems


def _member_group(all_ranks: List[List[int]], rank: int, backend_groups: list):
    """Every rank must create every group (a collective); keep the one this rank is in."""
    mine = None
    for ranks, group in zip(all_ranks, backend_groups):
        if rank in ranks:
            mine = (group, ranks)
    return mine


class ProcessGroups:
    """The sequence, data, sequence x data, ulysses and ring groups of this rank.

    Built collectively: every rank of the world must construct one, in the same order. comm.new_group
    keeps one handle per rank list, so groups with the same ranks (the ring groups of a plain ring,
    the one-rank groups) are created once.
    """

    def __init__(self, dims: ParallelDims, rank: int, timeout_s: float, data_groups: bool = True):
        self.dims = dims
        self.coords = dims.coords(rank)
        world = [list(range(dims.world_size))]
        self.seq_data_group, self.seq_data_ranks = self._build(world, rank, timeout_s)
        self.sp_group, self.sp_ranks = self._build(dims.sp_group_ranks(), rank, timeout_s)
        # a dynamic family (ds_seqpar.dynamic) reduces over every rank and never over replicas of
        # one size: it builds no data-parallel groups (None)
        self.dp_group, self.dp_ranks = self._build(dims.dp_group_ranks(), rank, timeout_s) if data_groups \
            else (None, None)
        self.ulysses_group, self.ulysses_ranks = self._build(dims.ulysses_group_ranks(), rank, timeout_s)
        self.ring_group, self.ring_ranks = self._build(dims.ring_group_ranks(), rank, timeout_s)
        # DeepSpeed all-reduces grad norms over the model-parallel group: here that is one rank.
        singletons = [[r] for r in range(dims.world_size)]
        self.model_group, _ = self._build(singletons, rank, timeout_s)

    @staticmethod
    def _build(all_ranks, rank, timeout_s):
        groups = [comm.new_group(ranks, timeout_s) for ranks in all_ranks]
        return _member_group(all_ranks, rank, groups)


class SequenceParallelMPU:
    """What ``deepspeed.initialize(mpu=...)`` queries (see deepspeed/utils/groups.py).

    DeepSpeed is shown plain data parallelism over every rank (the sequence x data group), with
    the replica count for batch arithmetic:

      * ``get_data_parallel_group`` / ``get_sequence_data_parallel_group``: the sequence x data
        group. ZeRO reduces gradients and shards optimizer state over it, and ZeRO-3 partitions a
        model not built under ``zero.Init`` over ``get_data_parallel_group()``; a narrower group
        would leave the ranks of one sequence with unsynchronised weights.
      * ``get_data_parallel_world_size`` / ``_rank``: replicas (world / sequence size), what
        train_batch_size and samplers count: the ranks of one sequence share its samples.
      * no ``get_sequence_parallel_*``: DeepSpeed then averages gradients over all ranks at every
        ZeRO stage and on every reduction path (stage 3's reduce-scatter has no sequence term
        while stages 0-2 have one, so reporting the sequence size would make the right loss
        factor depend on the stage). sp.loss scales its backward by P to match (zero.py).
      * model / tensor parallelism: one rank (norms are not summed twice; checkpoints record
        tensor-parallel degree 1, which ds_to_universal needs).

    DeepSpeed asking for the group it reduces over is how the mpu learns that DeepSpeed averages
    this run's gradients: ``handed_to_deepspeed`` turns true and stays true.
    """

    def __init__(self, groups: ProcessGroups):
        self._g = groups
        self.handed_to_deepspeed = False

    @property
    def sequence_size(self) -> int:
        """Ranks per sequence (P): the factor sp.loss needs once DeepSpeed averages over all ranks."""
        return self._g.dims.sp_size

    # data parallel as DeepSpeed sees it: the group is every rank, the size counts replicas
    def get_data_parallel_group(self):
        self.handed_to_deepspeed = True
        return self._g.seq_data_group

    def get_data_parallel_world_size(self) -> int:
        return self._g.dims.dp_size

    def get_data_parallel_rank(self) -> int:
        return self._g.coords.dp_rank

    def get_data_parallel_group_ranks(self) -> List[int]:
        return list(self._g.seq_data_ranks)

    # sequence x data: where ZeRO shards optimizer state and reduces gradients
    def get_sequence_data_parallel_group(self):
        self.handed_to_deepspeed = True
        return self._g.seq_data_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self._g.dims.world_size

    def get_sequence_data_parallel_rank(self) -> int:
        return self._g.coords.rank

    # no model (tensor) parallelism
    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_group(self):
        return self._g.model_group

    def get_tensor_model_parallel_group(self):
        return self._g.model_group

    def get_tensor_model_parallel_world_size(self) -> int:
        return 1

    def get_tensor_model_parallel_rank(self) -> int:
        return 0

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1
