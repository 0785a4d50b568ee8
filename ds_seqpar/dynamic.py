"""DynamicSequenceParallel: runs the scheduler's rounds (schedule/rounds.py) with the existing
strategies, ``"sequence_parallel": {"size": "dynamic", "max_tokens_per_rank": T}``.

Groups exist once: one SequenceParallel per size of the family (schedule.family_sizes: powers of
two dividing the world, and the world), built in ascending order at construction on every rank,
each with its aligned sequence groups (ranks [k*s, (k+1)*s)) and no data-parallel groups; with
ulysses_size U > 1 the sizes U divides run the 2D hybrid (all-to-all over aligned blocks of U,
the ring across them), the smaller ones the ring alone. Groups with the same ranks are one handle
(comm.new_group), so the family is schedule.family_groups. A step only selects among them.

The loss of a step is the mean over all target tokens of the global batch. A micro-batch's loss is
its ranks' token-loss sum over that count; its backward is scaled by the world size once DeepSpeed
averages gradients over every rank (deepspeed.initialize(mpu=dsp.mpu): DeepSpeed sees plain data
parallelism over all ranks), so the step's gradient equals plain data parallelism's on the same
documents at every ZeRO stage. Within a group the strategies' own contract holds: the sum over
the group's ranks of each rank's gradient is the whole document's gradient (loss.py).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Union

import torch

from . import comm, strategies
from .config import ConfigError, SequenceParallelConfig, load_ds_config
from .kernels.base import check_head_groups
from .loss import _ScaleGrad, local_loss_sum
from .schedule import (MicroBatch, ModelShape, Schedule, check_max_tokens, family_sizes, schedule,
                       ulysses_degree)
from .sequence_parallel import SequenceParallel
from .sharding.batch import IGNORE_INDEX


class DynamicSequenceParallel:
    def __init__(self, config: Union[SequenceParallelConfig, Mapping[str, Any]], heads: Optional[int] = None,
                 kv_heads: Optional[int] = None, device=None):
        if not isinstance(config, SequenceParallelConfig):
            config = SequenceParallelConfig.parse(config)
        if not config.is_dynamic:
            raise ConfigError(f"DynamicSequenceParallel needs sequence_parallel.size='dynamic', got size={config.size}; "
                              f"use SequenceParallel for a fixed size")
        if not comm.is_initialized():
            raise RuntimeError("DynamicSequenceParallel needs torch.distributed: call deepspeed.init_distributed() first")
        self.heads = check_dynamic_heads(config, heads, kv_heads)
        sizes = family_sizes(config.strategy, comm.world_size(), self.heads, config.ulysses_size)
        check_max_tokens(config.strategy, sizes, config.max_tokens_per_rank, config.ulysses_size)
        check_dynamic_chunks(config, sizes, self.heads, kv_heads)
        # collective: every rank builds every size's groups, in the same (ascending) order; no
        # data-parallel groups (gradients are reduced over every rank), so the family is the world,
        # the one-rank groups, each size's sequence groups and the 2D hybrid's all-to-all blocks and
        # rings (schedule.family_groups)
        self._setup(config, {s: SequenceParallel(static_config(config, s), device, data_groups=False)
                             for s in sizes})

    @classmethod
    def fixed(cls, sp: SequenceParallel, max_tokens_per_rank: int) -> "DynamicSequenceParallel":
        """The same execution with one size, ``sp``'s: static sequence parallelism over documents
        packed into rows of sp.size x ``max_tokens_per_rank`` tokens, with the same token-level
        loss (the main job's --lengths with an integer size). Builds no group."""
        config = SequenceParallelConfig.parse(dict(sp.config.model_dump(), size="dynamic",
                                                   max_tokens_per_rank=max_tokens_per_rank, ulysses_size=1))
        out = cls.__new__(cls)
        out.heads = None
        out._setup(config, {sp.size: sp}, fixed=True)
        return out

    def _setup(self, config: SequenceParallelConfig, by_size: Dict[int, SequenceParallel], fixed: bool = False) -> None:
        self.config, self.by_size, self.is_fixed = config, by_size, fixed
        self.sizes = tuple(sorted(by_size))
        self.world_size, self.global_rank = comm.world_size(), comm.global_rank()
        self._current = by_size[self.sizes[0]]
        self._running: Optional[MicroBatch] = None

    @classmethod
    def from_ds_config(cls, ds_config, heads: Optional[int] = None, kv_heads: Optional[int] = None,
                       device=None) -> "DynamicSequenceParallel":
        """Build from a DeepSpeed config (dict or JSON path). DeepSpeed's batch keys need no check
        here: through dsp.mpu every rank is a replica, as in plain data parallelism."""
        return cls(SequenceParallelConfig.from_ds_config(load_ds_config(ds_config)), heads, kv_heads, device)

    # -- what DeepSpeed and the model see --------------------------------------------------------
    @property
    def mpu(self):
        """DeepSpeed averages over every rank with any family's mpu; dynamic: the size-1 family's,
        plain data parallelism over every rank."""
        return self.by_size[self.sizes[0]].mpu

    @property
    def groups(self):
        """The smallest family's process groups (its seq_data_group is every rank)."""
        return self.by_size[self.sizes[0]].groups

    @property
    def size(self):
        """``"dynamic"``, or the one size of ``fixed``."""
        return self.sizes[0] if self.is_fixed else self.config.size

    @property
    def dp_size(self) -> int:
        """Replicas as DeepSpeed counts them: with dynamic groups every rank is one."""
        return self.world_size // self.sizes[0]

    @property
    def dp_rank(self) -> int:
        return self.global_rank // self.sizes[0]

    @property
    def rank(self) -> int:
        """The rank inside the smallest family's group (0 when that is one rank)."""
        return self.global_rank % self.sizes[0]

    @property
    def kernel(self):
        return self.by_size[self.sizes[0]].kernel

    @property
    def max_tokens_per_rank(self) -> int:
        return self.config.max_tokens_per_rank

    @property
    def capacity(self) -> int:
        """The longest document a step can hold: the largest group x T."""
        return self.sizes[-1] * self.max_tokens_per_rank

    @property
    def device(self) -> torch.device:
        return self._current.device

    @property
    def strategy_name(self) -> str:
        return self._current.strategy_name

    @property
    def current(self) -> SequenceParallel:
        """The SequenceParallel of the micro-batch now running (``running``)."""
        return self._current

    @property
    def running_batch(self) -> Optional[MicroBatch]:
        """The micro-batch of the innermost ``running`` block, None outside one."""
        return self._running

    def attention(self, *args, **kwargs):
        return self._current.attention(*args, **kwargs)

    def linear_attention(self, *args, **kwargs):
        return self._current.linear_attention(*args, **kwargs)

    def token_logprobs(self, *args, **kwargs):
        """sp.token_logprobs of the running micro-batch's group (per-token, local: the group only sets the
        default chunk)."""
        return self._current.token_logprobs(*args, **kwargs)

    def token_logprobs_from_hidden(self, *args, **kwargs):
        return self._current.token_logprobs_from_hidden(*args, **kwargs)

    def sequence_sum(self, *args, **kwargs):
        """Per-row sums over the running micro-batch's group (its documents are whole inside the group)."""
        return self._current.sequence_sum(*args, **kwargs)

    def sequence_mean(self, *args, **kwargs):
        return self._current.sequence_mean(*args, **kwargs)

    @property
    def stats(self) -> comm.CommStats:
        """Every group's CommStats summed (a snapshot; reset_stats clears them)."""
        out = comm.CommStats()
        for sp in self.by_size.values():
            for kind in sp.stats.calls:
                out.bytes[kind] += sp.stats.bytes[kind]
                out.calls[kind] += sp.stats.calls[kind]
                out.seconds[kind] += sp.stats.seconds[kind]
        return out

    def reset_stats(self) -> None:
        for sp in self.by_size.values():
            sp.stats.reset()

    # -- a step ----------------------------------------------------------------------------------
    def schedule(self, lengths: Sequence[int], loss_tokens: Optional[int] = None,
                 shape: ModelShape = ModelShape(), round_price: Optional[float] = None,
                 pricer: Optional[Callable[[int, int], float]] = None) -> Schedule:
        """The step's rounds for this global batch (the same on every rank: pure), each document priced
        by the cost model (cost/documents.py: ``price`` of ``shape``, or ``pricer(length, group size)``,
        e.g. a DocumentPricer at a GPU's rates, as ``ds-seqpar plan --lengths`` places). ``round_price``:
        what one more round costs in the price's units; given, a round is also added for balance when
        the rounds are full (schedule.rounds, rule 4)."""
        try:
            return schedule(lengths, self.world_size, self.max_tokens_per_rank, self.sizes, self.config.strategy,
                            shape, loss_tokens, self.config.ulysses_size, pricer=pricer, round_price=round_price)
        except ValueError as err:
            if self.heads is None or self.sizes[-1] == self.world_size:
                raise
            raise ValueError(f"{err} (ulysses: a group splits the {self.heads} heads, so group sizes are "
                             f"{list(self.sizes)}; zigzag, ring, striped split tokens and use every size)") from None

    @contextmanager
    def running(self, mb: MicroBatch):
        """Attention calls inside go to ``mb``'s group; yields that size's SequenceParallel."""
        sp = self.by_size[mb.group.size]
        if sp.groups.sp_ranks != list(mb.group.ranks):
            raise ValueError(f"rank {self.global_rank} runs a micro-batch of group {mb.group}, whose ranks "
                             f"{list(mb.group.ranks)} are not its size-{mb.group.size} group "
                             f"{sp.groups.sp_ranks}; pass schedule.for_rank(this rank)")
        previous = self._current, self._running
        self._current, self._running = sp, mb
        try:
            yield self._current
        finally:
            self._current, self._running = previous

    def batch(self, mb: MicroBatch, documents: Sequence[torch.Tensor]) -> Dict[str, torch.Tensor]:
        """This rank's shard of ``mb``: ``documents`` are the token ids [length] of mb.documents, in
        order. Packed with position_ids restarting per document; labels shifted inside each one.
        An empty micro-batch is one ignored token (padded to the group's layout): a forward with
        no loss that keeps the ranks' passes in step."""
        sp = self.by_size[mb.group.size]
        if mb.empty:
            ids = torch.zeros(1, 1, dtype=torch.long)
            return sp.shard_batch({"input_ids": ids, "labels": torch.full_like(ids, IGNORE_INDEX)})
        if [int(d.numel()) for d in documents] != list(mb.lengths):
            raise ValueError(f"documents of lengths {[int(d.numel()) for d in documents]} do not match the "
                             f"micro-batch's {list(mb.lengths)}")
        ids = torch.cat([d.reshape(-1).long() for d in documents])[None]                   # [1, N]
        return sp.shard_batch({"input_ids": ids, "labels": ids, "cu_seqlens": list(mb.cu_seqlens)})

    def loss(self, logits_blv: torch.Tensor, labels_bl: torch.Tensor, mb: MicroBatch,
             grad_scale: Optional[float] = None, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
        """This rank's share of the global batch's token-level mean: its token-loss sum / the batch's
        target tokens (no communication). Summed over ranks and rounds it is the step's loss
        (``step_loss``). Backward times ``grad_scale``: the world size once DeepSpeed averages the
        gradients over every rank, else 1."""
        loss_sum, _ = local_loss_sum(logits_blv, labels_bl, ignore_index)
        scale = (self.world_size if self.mpu.handed_to_deepspeed else 1.0) if grad_scale is None else grad_scale
        if scale != 1.0:
            loss_sum = _ScaleGrad.apply(loss_sum, float(scale))
        return loss_sum / max(mb.loss_tokens, 1)

    def step_loss(self, share: float) -> float:
        """The step's loss from every rank's summed shares: one all-reduce over the world."""
        total = torch.tensor([float(share)], dtype=torch.float64)
        return comm.all_reduce_sum(total, self.groups.seq_data_group).item()

    def __repr__(self) -> str:
        return (f"DynamicSequenceParallel(strategy={self.config.strategy!r}, sizes={list(self.sizes)}, "
                f"max_tokens_per_rank={self.max_tokens_per_rank}, world={self.world_size})")


def train_step(dsp: DynamicSequenceParallel, engine, documents: Sequence[torch.Tensor],
               forward: Optional[Callable] = None, clock: Callable[[], float] = time.process_time,
               schedule: Optional[Schedule] = None) -> Dict[str, Any]:
    """One optimizer step of a DeepSpeed engine over a global batch of documents (token id tensors,
    the same list on every rank): schedule, then every round's micro-batch forward + backward on
    its group, the engine's accumulation boundary at the last round, one engine.step().
    ``forward(engine, batch) -> logits`` (default: the own LM's call). Returns the step's loss
    (token-level mean), this rank's compute seconds and tokens, and the schedule (``schedule``: one made
    already, else dsp.schedule's of the documents)."""
    forward = forward or (lambda eng, b: eng(b["input_ids"], b["position_ids"], cu_seqlens=b.get("cu_seqlens")))
    schedule = schedule or dsp.schedule([int(d.numel()) for d in documents])
    mine = schedule.for_rank(dsp.global_rank)
    share, compute_s, tokens = 0.0, 0.0, 0
    for k, mb in enumerate(mine):
        engine.set_gradient_accumulation_boundary(k == len(mine) - 1)
        with dsp.running(mb):
            batch = {key: v.to(engine.device) if isinstance(v, torch.Tensor) else v
                     for key, v in dsp.batch(mb, [documents[i] for i in mb.documents]).items()}
            c0 = clock()
            loss = dsp.loss(forward(engine, batch), batch["labels"], mb)
            engine.backward(loss, scale_wrt_gas=False)      # the divisor is the batch's tokens, not rounds
            compute_s += clock() - c0
        share += loss.item()
        tokens += mb.tokens // mb.group.size
    engine.step()
    return {"loss": dsp.step_loss(share), "compute_s": compute_s, "tokens": tokens, "schedule": schedule,
            "rounds": len(mine)}


def static_config(config: SequenceParallelConfig, size: int) -> SequenceParallelConfig:
    """The fixed-size section one group family runs with: the dynamic one at ``size``, the 2D
    hybrid where its ulysses_size divides the size, else the ring strategy alone."""
    return SequenceParallelConfig.parse(dict(config.model_dump(), size=size, max_tokens_per_rank=None,
                                             ulysses_size=ulysses_degree(size, config.ulysses_size)))


def check_dynamic_heads(config: SequenceParallelConfig, heads: Optional[int], kv_heads: Optional[int]):
    """Ulysses splits heads over a group, so its group sizes follow the heads: they must be known;
    the 2D hybrid splits them over its ulysses_size, which must divide them. From the config alone
    (the same message on every rank, before any collective)."""
    u = config.ulysses_size
    if heads is None:
        if config.strategy == "ulysses" or u > 1:
            what = "group sizes" if config.strategy == "ulysses" else f"sequence_parallel.ulysses_size={u}"
            raise ConfigError(f"sequence_parallel.strategy={config.strategy!r} with size='dynamic' and "
                              f"ulysses_size={u} needs the model's heads (DynamicSequenceParallel(cfg, heads=...)): "
                              f"{what} must divide them")
        return None
    check_head_groups(heads, kv_heads or heads)
    if heads % u:
        valid = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ConfigError(f"sequence_parallel.ulysses_size={u} with size='dynamic': the 2D hybrid splits the {heads} "
                          f"heads over {u} ranks; use a ulysses_size dividing {heads} ({', '.join(map(str, valid))})")
    return heads


def check_dynamic_chunks(config: SequenceParallelConfig, sizes: Sequence[int], heads: Optional[int],
                         kv_heads: Optional[int]) -> None:
    """A fixed ulysses_chunks must split the k/v heads of every group size's Ulysses ranks ("auto" picks per
    size); refused for the first size it does not, before any group exists."""
    if config.ulysses_chunks == "auto" or heads is None:
        return
    for size in sizes:
        try:
            strategies.check_heads(static_config(config, size), heads, kv_heads or heads)
        except ConfigError as err:
            raise ConfigError(f"{err} (with size='dynamic', at the group size {size}; 'auto' picks per size)") from None


__all__ = ["DynamicSequenceParallel", "check_dynamic_chunks", "train_step", "static_config"]
