"""SequenceParallel: the object users hold. It composes the pieces in a fixed order:

  1. validate the config against the world (before any collective, same message on every rank)
  2. build the process groups (sequence, data, sequence x data, ulysses, ring) and the mpu
  3. resolve the local attention kernel
  4. build the token layout and the strategy
  5. resolve the linear mixers' exchange (the hybrids' linear layers: lasp allgather / ring or ulysses)
Then ``mpu`` goes to ``deepspeed.initialize(mpu=sp.mpu)`` so ZeRO reduces over data x sequence.

Several SequenceParallel objects may live in one process (benchmarks compare strategies in one
run); each owns its groups and its CommStats.
"""
from __future__ import annotations

import math
import os
from typing import Any, Mapping, Optional, Union

import torch

from . import comm, ops, strategies
from .config import ConfigError, SequenceParallelConfig, load_ds_config
from .kernels import get_kernel
from .kernels.base import check_head_groups
from . import logprobs
from .loss import sequence_loss
from .memory.tiled_loss import sequence_loss_from_hidden
from .sharding.batch import shard_batch
from .sharding.layouts import make_layout
from .sharding.batch_masks import BatchMasks
from .sharding.padding import check_seq_len, pad_to, padded_len
from .cost.chunks import chunk_rule
from .strategies import StrategyContext, get_strategy
from .strategies.linear_exchange import LinearExchange
from .topology import ParallelDims, ProcessGroups, SequenceParallelMPU
from .zero import check_ds_config, loss_grad_scale


class SequenceParallel:
    def __init__(self, config: Union[SequenceParallelConfig, Mapping[str, Any]],
                 device: Optional[Union[str, torch.device]] = None, data_groups: bool = True):
        if not isinstance(config, SequenceParallelConfig):
            config = SequenceParallelConfig.parse(config)
        _require_distributed()
        self.config = config
        # 1. validation that needs only the world size: identical on every rank, before any collective
        world = comm.world_size()
        config.check_world(world)
        self.dims = ParallelDims(world, config.size, config.effective_ulysses_size)
        # 2. groups (collective: every rank builds every group, in the same order)
        self.groups = ProcessGroups(self.dims, comm.global_rank(), config.timeout_s, data_groups)
        self.mpu = SequenceParallelMPU(self.groups)
        # 3. kernel
        self.device = torch.device(device) if device is not None else _default_device()
        self.kernel = get_kernel(config.backend, self.device)
        # 4. layout (the configured strategy's, cut into Ulysses pieces for the hybrid), strategy
        layout_name = get_strategy(config.strategy).layout_name
        self.layout = make_layout(layout_name, self.dims.ring_size, self.dims.ulysses_size)
        self.stats = comm.CommStats()
        # the running batch's masks, their plans and its agreed documents (sharding/batch_masks.py): ops/ and
        # shard_batch call it; the strategy gets its plans
        self.masks = BatchMasks(self.groups.sp_group, self.stats, self.dims.sp_size, self.layout.required_multiple)
        c = self.groups.coords
        self.strategy = strategies.build(config, StrategyContext(
            sp_group=self.groups.sp_group, ulysses_group=self.groups.ulysses_group,
            ring_group=self.groups.ring_group, sp_size=self.dims.sp_size, sp_rank=c.sp_rank,
            ulysses_size=self.dims.ulysses_size, ulysses_rank=c.ulysses_rank,
            ring_size=self.dims.ring_size, ring_rank=c.ring_rank, kernel=self.kernel, stats=self.stats,
            layout=self.layout, plans=self.masks.plans, overlap=config.overlap, lasp_comm=config.lasp_comm,
            ulysses_chunks=chunk_rule(config.ulysses_chunks, self.device.type, _device_name(self.device),
                                      self.dims.ulysses_size, config.overlap)))
        # 5. the linear exchange, over the same groups, layout and stats as the strategy
        self.linear_exchange = LinearExchange(config.linear_strategy, config.lasp_comm, self.strategy.ctx)
        self._handle = ops.handle(self)      # how the opaque ops (ops/) find this object when they run
        ops.handle(self.group), ops.handle(self.stats)     # the loss's and unshard's collectives find them
                                                           # (ops/reduce.py)

    @classmethod
    def from_ds_config(cls, ds_config, device=None) -> "SequenceParallel":
        """Build from a DeepSpeed config (dict or JSON path); also checks the settings DeepSpeed
        would get wrong with sequence parallelism (zero.py), before any communication."""
        ds = load_ds_config(ds_config)
        cfg = SequenceParallelConfig.from_ds_config(ds)
        _require_distributed()
        world = comm.world_size()
        cfg.check_world(world)
        check_ds_config(ds, cfg.size, world // cfg.size)
        return cls(cfg, device=device)

    @property
    def loss_grad_scale(self) -> float:
        """Factor on sp.loss's backward: P once DeepSpeed reduces this run's gradients (it then
        averages over every rank, deepspeed.initialize(mpu=sp.mpu)), else 1; see zero.py."""
        return loss_grad_scale(self.mpu)

    # -- topology ------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return self.dims.sp_size

    @property
    def rank(self) -> int:
        return self.groups.coords.sp_rank

    @property
    def group(self):
        return self.groups.sp_group

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    @property
    def dp_rank(self) -> int:
        return self.groups.coords.dp_rank

    @property
    def dp_group(self):
        return self.groups.dp_group

    @property
    def strategy_name(self) -> str:
        return self.strategy.name

    # -- tokens --------------------------------------------------------------------------------
    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Global-order tensor -> this rank's tokens, in the strategy's layout. A length the layout
        cannot split is padded with zeros at the end first (padding.py); pass the real length as
        ``seq_len`` to attention (non-causal) and unshard."""
        dim = dim % x.dim()
        x = pad_to(x, dim, self.padded_len(x.shape[dim]))
        return self.layout.shard(x, dim, self.rank)

    def unshard(self, local: torch.Tensor, dim: int = 1, seq_len: Optional[int] = None) -> torch.Tensor:
        """Inverse of shard: every rank gets the global-order tensor (differentiable); ``seq_len``
        drops the end padding that shard added."""
        dim = dim % local.dim()
        gathered = ops.all_gather(local, dim, self.group, self.stats, kind="unshard")
        full = self.layout.unshard(list(gathered.chunk(self.size, dim=dim)), dim)
        if seq_len is not None:
            check_seq_len(seq_len, full.shape[dim], self.layout.required_multiple)
            full = full.narrow(dim, 0, seq_len)
        return full

    def position_ids(self, seq_len: int, device=None) -> torch.Tensor:
        """Global positions of this rank's tokens (for RoPE); end padding continues the count."""
        return self.layout.indices(self.padded_len(seq_len), self.rank).to(device or self.device)

    def padded_len(self, seq_len: int) -> int:
        """The length shard() pads ``seq_len`` to: the next multiple the layout can split."""
        return padded_len(self.layout, seq_len)

    # -- attention -----------------------------------------------------------------------------
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                  softmax_scale: Optional[float] = None, seq_len: Optional[int] = None,
                  cu_seqlens=None, window: Optional[int] = None, softcap: Optional[float] = None,
                  sinks: Optional[torch.Tensor] = None, blocks=None) -> torch.Tensor:
        """Exact softmax attention over the whole sequence; q, k, v are this rank's shards [b, s, h, d].
        ``seq_len``: the real global length when shard() padded the sequence; padding keys are then
        excluded (causal attention never sees them anyway, padding.py). ``cu_seqlens``: packed
        documents [0, l1, l1+l2, ..., N], global and the same on every rank, batch size 1: no token
        attends across a document boundary (masks.py; strategies/mask_plan.py).
        ``window``: transformers' sliding_window: query i sees keys j with i - window < j <= i
        (non-causal: |i - j| < window), inside each document; blocks outside it are neither computed
        nor sent. ``softcap``: scores become softcap * tanh(scores / softcap). ``sinks`` [heads]: one
        logit per q head added to every row's softmax denominator (gpt-oss), differentiable; its
        gradient on each rank is that rank's share (sum over the sequence group = the whole).
        ``blocks``: bidirectional blocks inside the causal mask, global (start, end) pairs in order, the
        same on every rank (Gemma 3's image tokens): a query in [start, end) also sees the block's later
        keys; each block inside one document, the window still bounding a query's first key (masks.py).
        The Mask of the call is built on the batch's first call of its kind and found by the others
        (sp.masks: sharding/batch_masks.py)."""
        check_qkv(q, k, v)
        check_score_options(q, window, softcap, sinks)
        strategies.check_heads(self.config, q.shape[2], k.shape[2])
        if seq_len is not None:
            check_seq_len(seq_len, q.shape[1] * self.size, self.layout.required_multiple)
        scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        softcap = None if softcap is None else float(softcap)
        # one opaque node for torch.compile (ops/attention.py): sp.masks finds or builds the mask inside
        wire = self._comm_dtype(q.dtype)
        if wire == q.dtype:
            return ops.attention(self._handle, q, k, v, sinks, cu_seqlens, bool(causal), scale, seq_len, window,
                                 softcap, blocks)
        out = ops.attention(self._handle, q.to(wire), k.to(wire), v.to(wire), sinks, cu_seqlens, bool(causal), scale,
                            seq_len, window, softcap, blocks)
        return out.to(q.dtype)

    def linear_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         decay: Optional[torch.Tensor] = None, cu_seqlens=None) -> torch.Tensor:
        """Causal linear attention over the whole sequence (strategy 'lasp'); with ``cu_seqlens``
        (as in attention) the state restarts at every document start."""
        check_qkv(q, k, v)
        if decay is not None and decay.requires_grad:   # known while tracing; inside the op it may not be
            raise ValueError("linear attention: decay is a fixed input and gets no gradient; pass decay.detach()")
        wire = self._comm_dtype(q.dtype)       # one opaque node for torch.compile (ops/linear.py)
        if wire == q.dtype:
            return ops.linear_attention(self._handle, q, k, v, decay, cu_seqlens)
        return ops.linear_attention(self._handle, q.to(wire), k.to(wire), v.to(wire), decay, cu_seqlens).to(q.dtype)

    def _comm_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """sequence_parallel.comm_dtype: auto keeps the model's dtype (config.py)."""
        return _COMM_DTYPES.get(self.config.comm_dtype, dtype)

    # -- training helpers ----------------------------------------------------------------------
    def shard_batch(self, batch, ignore_index: int = -100):
        """Shift labels over the whole sequence, then shard every [batch, seq] tensor in the layout
        and add global position_ids (see sharding/batch.py). Packed documents (position_ids
        restarting at 0, or a cu_seqlens entry) also give ``cu_seqlens`` (global) and labels that
        never cross a document boundary."""
        return shard_batch(batch, self, ignore_index)

    def loss(self, logits, labels, ignore_index: int = -100, grad_scale: Optional[float] = None):
        """Mean over the non-ignored tokens of the whole sequence, same on every rank; backward
        gives this rank's share, times ``grad_scale``: by default P once DeepSpeed reduces the
        gradients (it averages over all ranks), else 1, so plain data parallelism results at every
        ZeRO stage (zero.py)."""
        scale = self.loss_grad_scale if grad_scale is None else grad_scale
        return sequence_loss(logits, labels, self.group, ignore_index, self.stats, scale)

    def loss_from_hidden(self, hidden, lm_head, labels, bias=None, chunk_tokens: Optional[int] = None,
                         ignore_index: int = -100, grad_scale: Optional[float] = None):
        """``sp.loss(lm_head(hidden), labels)`` with the head's matmul fused into the loss over chunks of
        ``chunk_tokens`` local tokens (default ``sequence_parallel.tiled_loss_tokens``; 0 = all at once):
        the [tokens, vocab] logits never exist; same value and gradients, same contract as loss.
        ``lm_head``: the head module (needed under ZeRO-3: it gathers the weight around the call) or
        its weight [vocab, hidden], with ``bias``."""
        scale = self.loss_grad_scale if grad_scale is None else grad_scale
        chunk = self.config.tiled_loss_tokens if chunk_tokens is None else chunk_tokens
        return sequence_loss_from_hidden(hidden, lm_head, labels, self.group, bias, chunk, ignore_index,
                                         self.stats, scale)

    # -- post-training: per-token log-probs and the reductions losses build from them (logprobs.py) --------
    def token_logprobs(self, logits, labels, ignore_index: int = -100, temperature: float = 1.0,
                       entropy: bool = False, chunk_tokens: Optional[int] = None):
        """This rank's [batch, local_seq] log p(label) under softmax(logits / temperature), 0 where the label
        is ignored; with ``entropy=True`` also (logp, entropy) of the tempered distribution. Labels as
        sp.shard_batch gives them; ``sp.unshard(logp)`` is the unsharded model's values in global order. No
        communication; the fp32 view of the logits exists ``chunk_tokens`` rows at a time (default
        sequence_parallel.tiled_loss_tokens, else 1024; 0 = all at once)."""
        return logprobs.token_logprobs(logits, labels, ignore_index, temperature, entropy, self._chunk(chunk_tokens))

    def token_logprobs_from_hidden(self, hidden, lm_head, labels, bias=None, ignore_index: int = -100,
                                   temperature: float = 1.0, entropy: bool = False,
                                   chunk_tokens: Optional[int] = None):
        """``sp.token_logprobs(lm_head(hidden), labels, ...)`` with the head fused in: never more than
        ``chunk_tokens`` rows of logits, forward or backward (the tiled head of sp.loss_from_hidden)."""
        return logprobs.token_logprobs_from_hidden(hidden, lm_head, labels, bias, ignore_index, temperature, entropy,
                                                   self._chunk(chunk_tokens))

    def sequence_sum(self, values, mask=None, grad_scale: Optional[float] = None):
        """[batch]: each row's sum over the whole sharded sequence (where ``mask`` is nonzero), the same on
        every rank of the group; one all-reduce. Backward: this rank's share times ``grad_scale`` (as sp.loss)."""
        return logprobs.sequence_sums(values, mask, self.group, self.stats, self._scale(grad_scale))

    def sequence_mean(self, values, mask, grad_scale: Optional[float] = None):
        """[batch]: each row's mean over its masked tokens of the whole sequence; one all-reduce."""
        return logprobs.sequence_means(values, mask, self.group, self.stats, self._scale(grad_scale))

    def token_mean(self, values, mask, grad_scale: Optional[float] = None):
        """Scalar: the mean over every masked token of the batch's whole sequences; one all-reduce."""
        return logprobs.token_mean(values, mask, self.group, self.stats, self._scale(grad_scale))

    def logprob_chunk(self) -> int:
        """Rows of fp32 logits the log-prob paths compute at once unless told: tiled_loss_tokens, else 1024."""
        return self.config.tiled_loss_tokens or logprobs.DEFAULT_CHUNK

    def _chunk(self, chunk_tokens: Optional[int]) -> int:
        return self.logprob_chunk() if chunk_tokens is None else chunk_tokens

    def _scale(self, grad_scale: Optional[float]) -> float:
        return self.loss_grad_scale if grad_scale is None else grad_scale

    def __repr__(self) -> str:
        return (f"SequenceParallel(strategy={self.strategy_name!r}, size={self.size}, rank={self.rank}, "
                f"ulysses={self.dims.ulysses_size}, ring={self.dims.ring_size}, dp={self.dp_size}, "
                f"backend={self.kernel.name!r})")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Shape, dtype and device agreement, checked before any communication."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, seq, heads, head_dim] (bshd), got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them first")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.shape[0] != k.shape[0] or k.shape[:2] != v.shape[:2] or q.shape[1] != k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must agree on batch and "
                         f"local sequence length, and k, v on heads")
    if k.shape[2] != v.shape[2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"k and v must have the same heads and q, k the same head_dim; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    check_head_groups(q.shape[2], k.shape[2])


def check_score_options(q: torch.Tensor, window, softcap, sinks) -> None:
    """window, softcap and sinks of sp.attention, checked before any communication (the same
    arguments give the same message on every rank)."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window={window!r}: a sliding window is a whole number of tokens >= 1 (transformers' "
                         f"sliding_window: query i sees keys i - window < j <= i); pass None for full attention")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not math.isfinite(softcap) or softcap <= 0):
        raise ValueError(f"softcap={softcap!r}: logit softcapping needs a finite number > 0 (Gemma 2 uses 50.0); "
                         f"pass None for no capping")
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point() or sinks.dim() != 1 \
            or sinks.shape[0] != q.shape[2]:
        got = f"{sinks.dtype} of shape {tuple(sinks.shape)}" if isinstance(sinks, torch.Tensor) else repr(sinks)
        raise ValueError(f"sinks must be a floating-point tensor [heads] with one logit per q head ({q.shape[2]}), "
                         f"got {got}")
    if sinks.device != q.device:
        raise ValueError(f"sinks must be on q's device {q.device}, got {sinks.device}")


_COMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _require_distributed() -> None:
    if not comm.is_initialized():
        raise RuntimeError("SequenceParallel needs torch.distributed: call deepspeed.init_distributed() "
                           "(or torch.distributed.init_process_group) first")


def _default_device() -> torch.device:
    if torch.cuda.is_available() and comm.backend_name() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _device_name(device: torch.device) -> str:
    """The CUDA device's name (cost/chunks.py finds its profile by it); '' elsewhere."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else ""


__all__ = ["SequenceParallel", "ConfigError"]
