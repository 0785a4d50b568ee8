"""TRL's online RL trainers (GRPOTrainer, RLOOTrainer) under the mixin (trainer.py): each sequence group is one
data-parallel process of the plain run, rollouts and all.

What TRL does per process, and what each rank of replica d does here instead:
  * data: TRL's RepeatSampler hands every process its prompts of one generation batch (``generation_batch_size``
    = micro batch x processes x steps_per_generation, whole groups of ``num_generations``). The mixin re-shards
    the loader over the replicas (trainer.py), and the generation batch is the replicas' (``fit_generation_batch``,
    before TRL sizes anything from it): every rank of replica d reads what process d of the plain run reads.
  * sampling: TRL seeds each process with seed + process index; the ranks of replica d are re-seeded with
    seed + d after TRL's init, so they all draw the same completions, those of plain process d, from the same
    generator state (``reseed``). Generation runs on the model as TRL calls it (``model.generate``): the applied
    model's, which prefills through the strategy and decodes over a sequence-sharded KV cache (hf/generate.py:
    left-padded prompts, sampling alike on every rank); for a model that decode does not cover (hybrids' linear
    layers, gradient checkpointing in training mode, ...) with sequence parallelism lifted for the call
    (``whole_model``: every rank decodes the whole prompts, as the plain process does). Prompts are checked
    equal across the group first (one all-reduce of a fingerprint).
  * scoring: the policy's, old policy's and reference's per-token log-probs and entropies come from TRL's fused
    LM head on whole rows (left-padded prompt, right-padded completion), which trl_rows.py shards inside the
    model and gathers back: every rank holds the replica's whole per-token vectors.
  * reductions: TRL gathers rewards, lengths and metrics, slices advantages by process index, normalises DAPO's
    loss by the process count, reduces entropy sums and pads entropies across processes. While its rollout and
    loss code runs, ``self.accelerator`` is a view (``ReplicaAccelerator``) whose process index and count are the
    replica's and whose gathers, reductions and padding run over the replicas (one value per replica: the
    group's ranks hold the same values), and the module's ``gather`` / ``gather_object`` are the replicas' too.
Every loss, advantage and metric is then the plain run's, computed on every rank of the group. Gradients: as for
DPO (trl_rows.py), P identical losses per group, each rank's gradient through its own tokens P times, which
DeepSpeed's average over data x sequence ranks turns into plain data parallelism's.

Refused by name at construction: vLLM and continuous-batching generation (another process or scheduler decodes),
a custom rollout function, tools and environments (multi-turn rollouts not verified), vision inputs.
"""
from __future__ import annotations

import hashlib
import sys
from contextlib import contextmanager
from typing import Callable

import torch

from .. import comm
from ..errors import ConfigError
from .trainer_batches import group_agrees

ROLLOUT_TRAINERS = ("GRPOTrainer", "RLOOTrainer")


def is_rollout(loss_owner: type) -> bool:
    return loss_owner.__name__ in ROLLOUT_TRAINERS


def fit_generation_batch(targs, sp, trainer_name: str) -> None:
    """TRL sized the generation batch from the world (micro x W x steps_per_generation); the plain run it must
    equal has dp_size processes: micro x dp x steps_per_generation, whole groups of num_generations."""
    steps = targs.steps_per_generation
    wanted = targs.per_device_train_batch_size * sp.dp_size * steps
    if wanted % targs.num_generations:
        raise ConfigError(f"ds_seqpar.hf: {trainer_name} with sequence_parallel.size={sp.size}: the generation batch "
                          f"is per_device_train_batch_size x data-parallel replicas x steps_per_generation = "
                          f"{targs.per_device_train_batch_size} x {sp.dp_size} x {steps} = {wanted}, not a multiple "
                          f"of num_generations={targs.num_generations}; raise per_device_train_batch_size or "
                          f"steps_per_generation so that it is")
    targs.generation_batch_size = wanted


def refuse_inexact(targs, kwargs, trainer_name: str) -> None:
    def refuse(option, why, fix):
        raise ConfigError(f"ds_seqpar.hf: {trainer_name} with {option} is not verified under sequence parallelism "
                          f"({why}); {fix}")

    if getattr(targs, "use_vllm", False):
        refuse("use_vllm=True", "vLLM generates in its own process or engine, outside the sequence group",
               "set use_vllm=False (in-process generation)")
    if getattr(targs, "use_transformers_paged", False) or getattr(targs, "use_transformers_continuous_batching",
                                                                 False):
        refuse("continuous-batching generation", "its scheduler orders requests per process",
               "use the model's own generate (the default)")
    for key in ("rollout_func", "environment_factory", "tools"):
        if kwargs.get(key):
            refuse(key, "multi-turn and custom rollouts are not checked against the plain trainer",
                   f"leave {key} unset")
    if getattr(targs, "top_entropy_quantile", 1.0) < 1.0 and getattr(targs, "use_liger_kernel", False):
        refuse("the Liger kernel", "its loss reads logits ds_seqpar does not gather", "set use_liger_kernel=False")


def reseed(targs, sp) -> None:
    """What TRL's set_seed(seed, device_specific=True) gives plain process d: seed + d, for every rank of replica d."""
    from accelerate.utils import set_seed
    set_seed(targs.seed + sp.dp_rank)


def check_group_prompts(batch, sp) -> None:
    """Every rank of the group holds the same prompts (the replica's rows): one all-reduce (max of h and -h)."""
    text = repr([row.get("prompt") if isinstance(row, dict) else row for row in batch]).encode()
    h = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") % (1 << 61)   # not hash(): salted
    if not group_agrees(h, sp):
        raise ConfigError("ds_seqpar.hf: the ranks of one sequence group got different prompts (a loader sharded per "
                          "world rank?); every rank of a group must read the same generation batch")


class ReplicaAccelerator:
    """The Accelerator as plain data-parallel process ``sp.dp_rank`` of ``sp.dp_size`` sees it: index, count,
    gathers, reductions and padding over the replicas; everything else is the trainer's own accelerator."""

    def __init__(self, accelerator, sp, gather_replicas: Callable):
        self._accelerator, self._sp, self._gather_replicas = accelerator, sp, gather_replicas

    def __getattr__(self, name):
        return getattr(self._accelerator, name)

    @property
    def process_index(self) -> int:
        return self._sp.dp_rank

    @property
    def num_processes(self) -> int:
        return self._sp.dp_size

    def gather(self, data):
        return replica_gather(data, self._gather_replicas, truncate=False)

    def gather_for_metrics(self, data, use_gather_object: bool = False):
        if use_gather_object or not _has_tensors(data):
            return replica_gather_object(data, self._sp)
        return replica_gather(data, self._gather_replicas, truncate=True)

    def reduce(self, tensor, reduction: str = "sum", scale: float = 1.0):
        total = comm.all_reduce(tensor.detach().clone(), self._sp.dp_group, stats=self._sp.stats, kind="trl_metrics")
        if reduction == "mean":
            total = total / self._sp.dp_size
        return total * scale if scale != 1.0 else total

    def pad_across_processes(self, tensor, dim: int = 0, pad_index=0, pad_first: bool = False):
        sp = self._sp
        size = torch.tensor([tensor.shape[dim]], dtype=torch.int64, device=sp.device)
        longest = int(comm.all_reduce(size, sp.dp_group, op="max", stats=sp.stats, kind="trl_metrics")[0])
        if tensor.shape[dim] == longest:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = longest - tensor.shape[dim]
        pad = tensor.new_full(shape, pad_index)
        return torch.cat([pad, tensor] if pad_first else [tensor, pad], dim=dim)


def replica_gather(data, gather_replicas: Callable, truncate: bool):
    """accelerate's gather (a scalar becomes one value per process) over the replicas."""
    if isinstance(data, (tuple, list)):
        return type(data)(replica_gather(d, gather_replicas, truncate) for d in data)
    if isinstance(data, dict):
        return {k: replica_gather(v, gather_replicas, truncate) for k, v in data.items()}
    if not isinstance(data, torch.Tensor):
        return data
    return gather_replicas(data.reshape(1) if data.dim() == 0 else data, truncate)


def replica_gather_object(obj, sp) -> list:
    """accelerate's gather_object (every process's list, concatenated in process order) over the replicas."""
    parts = comm.gather_object(obj, sp.dp_group) if sp.dp_size > 1 else [obj]
    return [x for part in parts for x in part]


def _has_tensors(data) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, (tuple, list)):
        return any(_has_tensors(d) for d in data)
    if isinstance(data, dict):
        return any(_has_tensors(d) for d in data.values())
    return False


@contextmanager
def replica_view(trainer, owner: type):
    """While TRL's rollout or loss code runs: ``trainer.accelerator`` the replicas' view, and the trainer module's
    imported ``gather`` / ``gather_object`` the replicas' (TRL calls them by name)."""
    module = sys.modules[owner.__module__]
    real = trainer.accelerator
    own = {name: vars(module).get(name) for name in ("gather", "gather_object")}
    if isinstance(real, ReplicaAccelerator):        # nested (a loss inside a rollout): already the view
        yield
        return
    trainer.accelerator = ReplicaAccelerator(real, trainer.sp, trainer._gather_replicas)
    module.gather = lambda data: replica_gather(data, trainer._gather_replicas, truncate=False)
    module.gather_object = lambda obj: replica_gather_object(obj, trainer.sp)
    try:
        yield
    finally:
        trainer.accelerator = real
        for name, fn in own.items():
            if fn is not None:
                setattr(module, name, fn)


def decodes_sharded(model) -> bool:
    """Whether the applied model's generate decodes over the sequence-sharded cache (hf/generate.py checks the
    model's features, purely and alike on every rank, for left-padded prompts: TRL pads them so); else the
    rollouts lift sequence parallelism."""
    from .apply import STATE_ATTR
    from .checks import UnsupportedModelError
    from .generate import check_model
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        return False
    try:
        check_model(model, state, left_padded=True)
    except UnsupportedModelError:
        return False
    return True


@contextmanager
def whole_model(model, sp):
    """Sequence parallelism lifted from ``model`` for the duration (generation on whole prompts, every rank alike),
    then applied again to the same object."""
    from .apply import STATE_ATTR, apply_sequence_parallel, remove_sequence_parallel
    if getattr(model, STATE_ATTR, None) is None:
        yield model
        return
    remove_sequence_parallel(model)
    try:
        yield model
    finally:
        apply_sequence_parallel(model, sp)


__all__ = ["ROLLOUT_TRAINERS", "decodes_sharded", "is_rollout", "fit_generation_batch", "refuse_inexact", "reseed",
           "check_group_prompts", "ReplicaAccelerator", "replica_view", "whole_model"]
