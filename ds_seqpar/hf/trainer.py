"""transformers.Trainer (and any subclass: TRL's SFTTrainer) with sequence parallelism from the
``sequence_parallel`` key of the DeepSpeed JSON the Trainer is given, step for step equal to plain
data parallelism.

    trainer = SequenceParallelTrainer(model=model, args=TrainingArguments(..., deepspeed="ds.json"), ...)
    trainer = sequence_parallel(SFTTrainer)(model=..., args=SFTConfig(..., deepspeed="ds.json"), ...)
    accelerate launch --config_file acc.yaml train.py   # deepspeed_config_file: ds.json in the YAML (ds_config.py)

With ``size: 1`` or no key the mixin steps aside: the same script is the plain data-parallel run.

Why it is exact (W = dp * P ranks; replica d is a sequence group of P ranks; S = loss sums):
  * data: the Trainer's loader is sharded over the W world ranks by accelerate; the mixin re-shards it
    over the dp replicas (every rank of a group reads the same batches, and replica d reads what
    process d of a plain dp-process run reads; worker seeds follow the replica). A cheap check on
    every batch (one all-reduce of a fingerprint) stops the run if a group ever disagrees.
  * batches: ``get_batch_samples`` passes every batch through ``sp.shard_batch`` (labels shifted over
    the whole sequence, then sharded; global position_ids, or a 3-D RoPE model's own whole-row positions
    when the batch has vision inputs; packed documents -> cu_seqlens) and adds
    ``shift_labels`` (= the shifted labels), so the Trainer counts the targets of the shards:
    disjoint, their count over the world is the plain count N of the accumulation window.
  * loss: with that count (``num_items_in_batch``, the Trainer's default for causal LMs) the routed
    loss is this rank's local sum / N (hf/loss.py); the Trainer multiplies by W and DeepSpeed (given
    sp.mpu) averages gradients over W: the gradient is (sum of every shard's sum) / N, plain's.
  * DeepSpeed: HF fills ``train_batch_size`` = W * micro * GA (and refuses other literals); with P
    ranks per replica the real global batch is dp * micro * GA, so that value is removed (DeepSpeed
    derives dp's from the mpu) and any other one refused with the fix (replica_batch_size). ``sp.mpu`` reaches deepspeed.initialize
    through a wrapper around this trainer's ``accelerator.prepare``, and the first step checks the
    engine holds it (an accelerate change fails loudly instead of training plain dp under our name).
  * right-padded batches (the collators' default): the mask is dropped, exact for causal models (no
    real query sees a later pad; the pads' targets are -100); left or inner zeros are refused.
Refused on every rank before any collective, naming the option: what would not be exact
(label smoothing, a custom compute_loss_func, average_tokens_across_devices=False, ...).
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Optional

import torch

from .. import comm
from ..config import ConfigError, SequenceParallelConfig
from ..deepspeed_shm import skip_deepspeed_shm_op
from ..sequence_parallel import SequenceParallel
from . import trainer_generate, trl_rollouts, trl_support
from .apply import apply_sequence_parallel
from .ds_config import trainer_deepspeed_config
from .metrics import StepMeter, meter_callback
from .trainer_refusals import (ROW_TRAINERS, VERIFIED_LOSSES, _owner, _refuse_inexact,  # noqa: F401
                               _refuse_unverified_eval, _refuse_unverified_loss)
from .trainer_batches import check_group_batch, drop_right_padding, replica_batch_size  # noqa: F401
from .trl_rows import WholeRowScoring
from .vision import has_vision_inputs, rope_positions
from .wandb_run import one_wandb_run, run_config_callback

# TrainingArguments starts DeepSpeed's comm backend (through accelerate) before any trainer exists, so the
# shared-memory op that training never uses (launch/env.skip_deepspeed_shm_op) is skipped on import here
skip_deepspeed_shm_op()


class SequenceParallelMixin:
    """Put before a Trainer class in the bases (``sequence_parallel(cls)`` does it)."""
    _ds_seqpar_mixin = True      # trainer_refusals.MIXIN_MARK: which classes in an MRO are the mixin's

    def __init__(self, *args, **kwargs):
        kwargs.update(zip(_init_parameters(type(self)), args))
        targs = kwargs.get("args")
        self.sp: Optional[SequenceParallel] = _sequence_parallel(targs)
        group_set = one_wandb_run(targs, self.sp, kwargs.get("model"))
        owner = _owner(type(self), "compute_loss")
        if self.sp is not None:
            _refuse_inexact(targs, kwargs)
            _refuse_unverified_loss(type(self))
            _refuse_unverified_eval(type(self), targs, kwargs)
            trainer_generate.refuse_inexact(targs, trainer_deepspeed_config(targs),
                                            _owner(type(self), "prediction_step").__name__)
            if trl_rollouts.is_rollout(owner):         # before TRL sizes its buffers from the generation batch
                trl_rollouts.refuse_inexact(targs, kwargs, owner.__name__)
                trl_rollouts.fit_generation_batch(targs, self.sp, owner.__name__)
        super().__init__(**kwargs)
        if self.sp is None:
            return
        self._sp_owner = owner
        self._sp_trl = trl_support.is_trl(owner)
        self._sp_rows = WholeRowScoring(self.sp, owner.__name__) if owner.__name__ in ROW_TRAINERS else None
        self._sp_rollout = trl_rollouts.is_rollout(owner)
        if self._sp_trl or self._sp_rows is not None:
            trl_support.refuse_inexact(self)
        apply_sequence_parallel(_base_model(self.model), self.sp)
        if self._sp_rows is not None and getattr(self, "ref_model", None) is not None:
            apply_sequence_parallel(_hf_module(self.ref_model), self.sp)
        self._sp_engine_checked = False
        self._wrap_prepare()
        self._sp_meter = StepMeter(self.sp)
        for callback in (run_config_callback(self.sp, self.model, group_set), meter_callback(self._sp_meter)):
            self.add_callback(callback)
        if self._sp_rollout:                # last: the generator state plain process dp_rank has after TRL's init
            trl_rollouts.reseed(targs, self.sp)

    # -- DeepSpeed gets sp.mpu ------------------------------------------------------------------
    def _wrap_prepare(self) -> None:
        import deepspeed
        accelerator, sp = self.accelerator, self.sp
        prepare = accelerator.prepare

        def prepare_with_mpu(*objects, **kw):
            real = deepspeed.initialize

            def initialize(*a, **k):
                if k.get("mpu") is None:
                    k["mpu"] = sp.mpu
                return real(*a, **k)

            deepspeed.initialize = initialize
            try:
                return prepare(*objects, **kw)
            finally:
                deepspeed.initialize = real

        accelerator.prepare = prepare_with_mpu

    def _check_engine(self, model) -> None:
        engine = getattr(self, "deepspeed", None) or model
        if getattr(engine, "mpu", None) is not self.sp.mpu:
            raise ConfigError("ds_seqpar.hf: the DeepSpeed engine did not receive sp.mpu (accelerate no longer calls "
                              "deepspeed.initialize inside accelerator.prepare?); refusing to train plain data "
                              "parallelism under sequence_parallel")
        self._sp_engine_checked = True

    def training_step(self, model, inputs, *args, **kwargs):
        if self.sp is not None and not self._sp_engine_checked:
            self._check_engine(model)
        if self.sp is not None and not self._sp_rollout:  # this rank's shard (whole-row trainers: inside the model)
            self._sp_meter.tokens += inputs["input_ids"].numel() // (self.sp.size if self._sp_rows else 1)
        return super().training_step(model, inputs, *args, **kwargs)

    def compute_loss(self, model, inputs, *args, **kwargs):
        if self.sp is not None and self._sp_rollout:
            if self.model.training:      # this rank's share of the rows the fused head scores
                rows = inputs["prompt_ids"].numel() + inputs["completion_ids"].numel()
                self._sp_meter.tokens += rows // self.sp.size
            with trl_rollouts.replica_view(self, self._sp_owner), self._sp_rows.scoring(self._scored_models()):
                return super().compute_loss(model, inputs, *args, **kwargs)
        if self.sp is not None and self._sp_rows is not None:
            with self._whole_rows():
                return super().compute_loss(model, inputs, *args, **kwargs)
        if self.sp is None or not self._sp_trl:
            return super().compute_loss(model, inputs, *args, **kwargs)
        return trl_support.compute_loss(self, super().compute_loss, self._gather_replicas, model, inputs, *args,
                                        **kwargs)

    # -- TRL's online RL trainers: rollouts per replica (trl_rollouts.py) --------------------------
    def _prepare_inputs(self, inputs):
        """GRPO / RLOO generate and score here (a generation batch in, this step's micro-batch out)."""
        if self.sp is None or not self._sp_rollout:
            return super()._prepare_inputs(inputs)
        with trl_rollouts.replica_view(self, self._sp_owner), self._sp_rows.scoring(self._scored_models()):
            return super()._prepare_inputs(inputs)

    def _generate(self, prompts):
        """The rollouts: TRL's own call of the model's generate, the scoring hooks paused. Over the sequence-sharded
        KV cache (hf/generate.py: every rank of the group decodes the replica's prompts from the same generator
        state, the plain run's tokens), or, for a model the sharded decode does not cover, on the whole prompts
        with sequence parallelism lifted for the call (trl_rollouts.whole_model)."""
        if self.sp is None or not self._sp_rollout:
            return super()._generate(prompts)
        model = _base_model(_hf_module(self.model))
        lifted = nullcontext() if trl_rollouts.decodes_sharded(model) else trl_rollouts.whole_model(model, self.sp)
        with self._sp_rows.paused(), lifted:
            return super()._generate(prompts)

    def _scored_models(self):
        models = [_base_model(_hf_module(self.model))]
        if getattr(self, "ref_model", None) is not None:
            models.append(_hf_module(self.ref_model))
        return models

    @contextmanager
    def _whole_rows(self):
        """TRL's whole-row trainers (trl_rows.py): the policy's and the reference's fused-head calls shard inside
        the model; TRL's metric gathers become the replicas' (each group holds its replica's values once)."""
        models = self._scored_models()
        accelerator = self.accelerator
        own = {name: vars(accelerator).get(name) for name in ("gather", "gather_for_metrics")}

        accelerator.gather = lambda data: trl_rollouts.replica_gather(data, self._gather_replicas, truncate=False)
        accelerator.gather_for_metrics = lambda data, **_: trl_rollouts.replica_gather(data, self._gather_replicas,
                                                                                       truncate=True)
        try:
            with self._sp_rows.scoring(models):
                yield
        finally:
            for name, fn in own.items():
                if fn is None:
                    delattr(accelerator, name)
                else:
                    setattr(accelerator, name, fn)

    # -- data: one stream per replica, sharded batches ------------------------------------------
    def get_train_dataloader(self):
        return self._per_replica(super().get_train_dataloader(), training=True)

    def get_eval_dataloader(self, *args, **kwargs):
        return self._per_replica(super().get_eval_dataloader(*args, **kwargs))

    def get_test_dataloader(self, *args, **kwargs):
        return self._per_replica(super().get_test_dataloader(*args, **kwargs))

    def _per_replica(self, loader, training: bool = False):
        """accelerate shards over the world ranks; a sequence group is one data-parallel process."""
        if self.sp is None:
            return loader
        from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard
        sampler = getattr(loader, "batch_sampler", None)
        dataset = getattr(loader, "dataset", None)
        if isinstance(sampler, BatchSamplerShard):
            sampler.num_processes, sampler.process_index = self.sp.dp_size, self.sp.dp_rank
        elif isinstance(dataset, IterableDatasetShard):
            dataset.num_processes, dataset.process_index = self.sp.dp_size, self.sp.dp_rank
        elif comm.world_size() > 1:
            raise ConfigError(f"ds_seqpar.hf: the dataloader ({type(loader).__name__}) is not one accelerate shards "
                              f"per process (dispatch_batches / a custom sampler?); its batches cannot be given to "
                              f"each sequence group whole; use a map-style dataset with dispatch_batches=False")
        base = getattr(loader, "base_dataloader", loader)      # accelerate's adapter iterates this DataLoader
        if training and getattr(base, "worker_init_fn", None) is not None:
            from transformers.trainer_utils import seed_worker
            base.worker_init_fn = partial(seed_worker, num_workers=self.args.dataloader_num_workers,
                                          rank=self.sp.dp_rank)
        return loader

    def get_batch_samples(self, epoch_iterator, num_batches, *args, **kwargs):
        if self.sp is None:
            return super().get_batch_samples(epoch_iterator, num_batches, *args, **kwargs)
        if self._sp_rollout:               # prompts to the trainer (it generates), checked the same on the group's ranks
            return super().get_batch_samples(map(self._check_prompts, epoch_iterator), num_batches, *args, **kwargs)
        if self._sp_rows is not None:      # whole rows to the trainer, checked the same on the group's ranks
            return super().get_batch_samples(map(self._check_rows, epoch_iterator), num_batches, *args, **kwargs)
        return super().get_batch_samples(map(self._shard_batch, epoch_iterator), num_batches, *args, **kwargs)

    def _check_prompts(self, batch):
        trl_rollouts.check_group_prompts(batch, self.sp)
        return batch

    def _check_rows(self, batch):
        check_group_batch(batch, self.sp)
        return batch

    def _shard_batch(self, batch):
        """One global batch (the same on the group's ranks: checked) -> this rank's shard."""
        batch = dict(batch)
        if batch.get("labels") is None:             # before the group's collective: every rank says it
            raise ConfigError("ds_seqpar.hf: the data collator returned no labels; sequence parallelism shifts them "
                              "over the whole sequence before sharding: use a collator that sets labels "
                              "(DataCollatorForLanguageModeling(mlm=False), DataCollatorWithFlattening, TRL's)")
        check_group_batch(batch, self.sp)
        tokens = trl_support.tokens_of(batch) if getattr(self, "_sp_trl", False) else None  # before the mask goes
        if has_vision_inputs(batch):                         # 3-D RoPE: the whole row's, before sharding
            positions = rope_positions(self.model, batch)
            if positions is not None:
                batch["position_ids"] = positions
        drop_right_padding(batch)
        out = self.sp.shard_batch(batch)
        out["shift_labels"] = out["labels"]                # what the Trainer counts: the shards' targets
        if tokens is not None:
            out[trl_support.TOKENS] = tokens
        return out

    # -- eval and predict: sequence-parallel, gathered over the replicas -------------------------
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
        """The step on this rank's shard, then the replica's view: the loss of the group (each rank
        holds its shard's share: their mean is what one plain data-parallel process reports), the
        logits unsharded to full length, the labels as the collator gave them. Seq2SeqTrainer's
        predict_with_generate: generated tokens instead of logits (trainer_generate.py)."""
        if self.sp is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys, **gen_kwargs)
        if self._sp_rows is None and trainer_generate.generates(self, _owner(type(self), "prediction_step").__name__,
                                                                prediction_loss_only):
            return trainer_generate.prediction_step(self, model, inputs, ignore_keys, gen_kwargs)
        if self._sp_rows is not None:      # TRL's own step on whole rows (its compute_loss: the replica's loss)
            check_group_batch(inputs, self.sp)
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        _refuse_unverified_eval(type(self), None, {"eval_dataset": True})
        labels, length = inputs.get("labels"), inputs["input_ids"].shape[1]
        shard = self._shard_batch(inputs)
        loss, logits, _ = super().prediction_step(model, dict(shard), prediction_loss_only, ignore_keys)
        if loss is not None and self._sp_trl:      # TRL: this rank's mean over its own targets
            loss = trl_support.eval_loss(loss, shard, self.sp)
        elif loss is not None:                     # Trainer: this rank's share of the step's global count
            loss = comm.all_reduce(loss.detach().float().reshape(1).clone(), self.sp.group, stats=self.sp.stats,
                                   kind="eval_loss")[0] / self.sp.size
        if logits is not None:
            logits = _map_tensors(lambda t: self.sp.unshard(t.contiguous(), dim=1, seq_len=length), logits)
        if labels is not None:
            labels = labels.to(self.args.device)
        return loss, logits, (None if prediction_loss_only else labels)

    def evaluation_loop(self, *args, **kwargs):
        """Gather over the data-parallel replicas (one rank per replica's values), with accelerate's
        truncation of the last batch: the world gather would hold every replica P times."""
        if self.sp is not None:
            self.gather_function = self._gather_replicas
        return super().evaluation_loop(*args, **kwargs)

    def _gather_replicas(self, data, truncate: bool = True, **_):
        state = self.accelerator.gradient_state
        keep = state.remainder if truncate and state.end_of_dataloader and state.remainder > 0 else None

        def gather(t):
            full = comm.all_gather_nograd(t.contiguous(), 0, self.sp.dp_group, self.sp.stats, kind="eval_gather")
            return full if keep is None else full[:keep]
        return _map_tensors(gather, data)

    # -- reporting ------------------------------------------------------------------------------
    def get_total_train_batch_size(self, args) -> int:
        if self.sp is None:
            return super().get_total_train_batch_size(args)
        return args.per_device_train_batch_size * args.gradient_accumulation_steps * self.sp.dp_size

    def log(self, logs, *args, **kwargs):
        if self.sp is not None and "loss" in logs:
            # the main job's vocabulary (hf/metrics.py; WandbCallback logs train/<name>); the sp/* names of
            # earlier releases for one more release (docs/dashboards.md)
            stats = self.sp.stats
            logs = dict(logs, step=self.state.global_step, **self._sp_meter.record(),
                        **{"sp/size": self.sp.size, "sp/comm_bytes": stats.total_bytes,
                           "sp/comm_seconds": stats.total_seconds})
            stats.reset()
        return super().log(logs, *args, **kwargs)


def sequence_parallel(trainer_cls):
    """``trainer_cls`` (transformers.Trainer or a subclass, e.g. TRL's SFTTrainer) with the mixin in front."""
    if issubclass(trainer_cls, SequenceParallelMixin):
        return trainer_cls
    return type(f"SequenceParallel{trainer_cls.__name__}", (SequenceParallelMixin, trainer_cls),
                {"__module__": __name__, "__doc__": f"{trainer_cls.__name__} under ds_seqpar sequence parallelism."})


def _map_tensors(fn, data):
    if isinstance(data, (tuple, list)):
        return type(data)(_map_tensors(fn, d) for d in data)
    return fn(data) if isinstance(data, torch.Tensor) else data


def _init_parameters(cls):
    base = next(c for c in cls.__mro__ if c is not SequenceParallelMixin and not issubclass(c, SequenceParallelMixin))
    return [n for n in inspect.signature(base.__init__).parameters if n != "self"]


def _hf_module(model):
    """The transformers model inside a DeepSpeed engine (TRL prepares its reference model as one)."""
    return getattr(model, "module", model) if type(model).__name__ == "DeepSpeedEngine" else model


def _base_model(model):
    """PEFT wraps the transformers model; the attention lives in the base."""
    getter = getattr(model, "get_base_model", None)
    return getter() if callable(getter) else model


def _sequence_parallel(targs) -> Optional[SequenceParallel]:
    """The SequenceParallel the DeepSpeed JSON asks for (None: size 1 or no key), with the batch keys
    made replica-aware first."""
    ds = trainer_deepspeed_config(targs)        # deepspeed='ds.json', or accelerate's DeepSpeed plugin
    cfg = SequenceParallelConfig.from_ds_config(ds)          # no key: size 1
    if cfg.is_dynamic:
        raise ConfigError("ds_seqpar.hf: SequenceParallelTrainer does not run sequence_parallel.size='dynamic' yet; "
                          "use an integer size here. The Trainer steps over a fixed number of micro-batches of rows, "
                          "while dynamic groups run each global batch of documents in rounds the scheduler picks per "
                          "step. Hugging Face models train with dynamic groups in the main job (python -m "
                          "ds_seqpar.train --model PATH --lengths FILE --sp_size dynamic) and in an own loop "
                          "(apply_sequence_parallel(model, DynamicSequenceParallel(...)), docs/dynamic.md)")
    if cfg.size == 1:
        return None
    world = comm.world_size()
    cfg.check_world(world)
    replica_batch_size(ds, world, cfg.size, targs.per_device_train_batch_size, targs.gradient_accumulation_steps)
    return SequenceParallel.from_ds_config(ds)


__all__ = ["SequenceParallelMixin", "sequence_parallel", "check_group_batch", "drop_right_padding"]
