"""SequenceParallelTrainer on the 4-rank pool against plain data parallelism on the same 4 ranks.

Plain: size 1, 4 replicas, micro batch 1. Sequence parallel: size P, 4/P replicas, micro batch P.
Every optimizer step then covers the same samples (the Trainer's sampler permutes indices the same
way for any batch size; replica d of a run with micro batch m reads batches d, d + dp, ...), and
the loss is the mean over the same tokens, so the logged loss, grad_norm and learning_rate per step
and the final parameters must agree: gradient accumulation 3 (not a multiple of P), variable-length
samples with -100 prompt masks, right padding in the sequence-parallel runs only, ZeRO 1/2/3.
Tolerance: fp32 runs that differ only in the order of sums; 100x the few ulps observed (module doc of
tests/e2e/test_examples_launch.py)."""
import functools
import importlib.util
import json
import os
import tempfile

import pytest
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))


def _example(name="hf_trainer"):
    spec = importlib.util.spec_from_file_location(f"{name}_example", os.path.join(ROOT, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ds_config(stage, **sequence_parallel):
    with open(os.path.join(ROOT, "configs", "trainer", "zigzag_zero2.json")) as f:
        cfg = json.load(f)
    cfg["zero_optimization"]["stage"] = stage
    cfg["sequence_parallel"] = sequence_parallel
    return cfg


def reset_worker_state():
    """After a Trainer run on a pool rank: accelerate's singletons, and transformers' global ZeRO-3
    config (a Trainer with ZeRO-3 leaves it set: every later from_config in this process would build
    its model partitioned inside zero.Init, so later tests on the pool would be slow and mismatched)."""
    from accelerate.state import AcceleratorState, PartialState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    AcceleratorState._reset_state(reset_partial_state=False)
    PartialState._reset_state()
    unset_hf_deepspeed_config()


def run_trainer(cfg, micro, steps=3, eval_samples=0, **options):
    """On every rank: one Trainer run; rank 0 returns (steps, params[, (eval_loss, logits, labels)])."""
    example = _example()
    with tempfile.TemporaryDirectory() as out:
        try:
            options.setdefault("gradient_accumulation_steps", 3)
            return example.train(cfg, out, max_steps=steps, per_device_train_batch_size=micro,
                                 eval_samples=eval_samples, **options)
        finally:
            reset_worker_state()


_PLAIN = {}


def plain_run(pool, stage, eval_samples=0, runner=None, *extra):
    """The plain data-parallel reference (size 1, micro batch 1), computed once per session: the
    launcher test (tests/e2e/test_examples_launch.py) compares against the same run."""
    runner = runner or run_trainer
    key = (runner.__name__, stage, eval_samples, extra)
    if key not in _PLAIN:
        cfg = ds_config(stage, strategy="zigzag", size=1)
        args = (cfg, 1) + ((3, eval_samples) if runner is run_trainer else extra)
        _PLAIN[key] = pool.run(runner, *args)[0]
    return _PLAIN[key]


def assert_same_training(what, got, want):
    steps, params = got[:2]
    ref_steps, ref_params = want[:2]
    assert [s["step"] for s in steps] == [s["step"] for s in ref_steps], what
    for g, w in zip(steps, ref_steps):
        assert g["learning_rate"] == w["learning_rate"], (what, g, w)
        for key in ("loss", "grad_norm"):
            assert abs(g[key] - w[key]) <= 1e-5 * abs(w[key]), (what, key, g, w)
    worst = max((params[n] - ref_params[n]).abs().max().item() for n in ref_params)
    assert worst <= 1e-5, f"{what}: final parameters differ from plain data parallelism by {worst:.3e}"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_trainer_equals_plain_data_parallelism(pool, stage):
    """At ZeRO-2 also eval and predict: 10 eval samples, so the last eval step holds 2 real samples of 4
    (accelerate pads with the first samples again and truncates after the gather); eval runs
    sequence-parallel, predict() returns full-length logits and the collator's labels. (Two replicas
    of 2 and four plain processes of 1 pad that step with the same samples; the Trainer normalises a
    step's eval loss by the tokens of the padded step, so plain's eval_loss depends on the replica
    count: the run compared has 2 replicas.)"""
    import numpy as np
    eval_samples = 10 if stage == 2 else 0
    plain = plain_run(pool, stage, eval_samples)
    cases = [dict(strategy="zigzag", size=2)]
    if stage == 2:            # every strategy family once, at the stage the examples use
        cases += [dict(strategy="ulysses", size=4), dict(strategy="ring", size=2),
                  dict(strategy="striped", size=4, ulysses_size=2)]
    if stage == 3:
        cases += [dict(strategy="ulysses", size=4)]
    for i, sp in enumerate(cases):
        evaluated = eval_samples if i == 0 else 0
        got = pool.run(run_trainer, ds_config(stage, **sp), sp["size"], 3, evaluated)[0]
        assert_same_training(f"ZeRO-{stage} {sp}", got, plain)
        if not evaluated:
            continue
        (loss, logits, labels), (ref_loss, ref_logits, ref_labels) = got[2], plain[2]
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (sp, loss, ref_loss)
        assert logits.shape[0] == ref_logits.shape[0] == 10, (logits.shape, ref_logits.shape)
        n = min(logits.shape[1], ref_logits.shape[1])      # batches pad to their own widths (-100 beyond)
        assert not (ref_labels[:, n:] != -100).any(), f"{sp}: logits cut short of real positions"
        real = ref_labels[:, :n] != -100
        assert np.abs(logits[:, :n][real] - ref_logits[:, :n][real]).max() <= 1e-4, sp
        assert (labels[:, :n][real] == ref_labels[:, :n][real]).all(), sp


@pytest.mark.parametrize("option", ["gradient_checkpointing", "lora"])
def test_gradient_checkpointing_and_lora_equal_plain(pool, option):
    """Gradient checkpointing (the attention's collectives run again in the recompute) and LoRA
    adapters (peft wraps the model; sequence parallelism goes on the base model)."""
    plain = pool.run(run_trainer, ds_config(2, strategy="zigzag", size=1), 1, 3, 0, **{option: True})[0]
    got = pool.run(run_trainer, ds_config(2, strategy="zigzag", size=2), 2, 3, 0, **{option: True})[0]
    assert_same_training(f"{option} zigzag P=2", got, plain)


def run_sft(cfg, micro, padding_free=False, packing=False, eval_samples=0, samples=48, evaluate=None):
    """On every rank: TRL's SFTTrainer with the mixin (examples/trl_sft.py); rank 0 returns (steps, params[,
    eval metrics])."""
    example = _example("trl_sft")
    with tempfile.TemporaryDirectory() as out:
        try:
            return example.train(cfg, out, max_steps=3, gradient_accumulation_steps=3, samples=samples,
                                 per_device_train_batch_size=micro, padding_free=padding_free, packing=packing,
                                 eval_samples=eval_samples, evaluate=evaluate)
        finally:
            reset_worker_state()


def predicted(trainer, eval_set):
    """predict(): the logits (full length, gathered) and the collator's labels."""
    pred = trainer.predict(eval_set)
    return pred.predictions, pred.label_ids


def evaluate_with_padding_rows(trainer, eval_set):
    """The plain run's evaluate() on the eval set, and on the eval set followed by its first rows up to a
    whole last step (the rows accelerate pads an uneven last batch with); and its predict()."""
    from datasets import concatenate_datasets
    step = trainer.args.per_device_eval_batch_size * trainer.accelerator.num_processes
    wrap = -len(eval_set) % step
    return (trainer.evaluate(), trainer.evaluate(concatenate_datasets([eval_set, eval_set.select(range(wrap))])),
            predicted(trainer, eval_set))


def evaluate_and_predict(trainer, eval_set):
    return trainer.evaluate(), predicted(trainer, eval_set)


def assert_same_trl_metrics(what, got, want, prefix=""):
    """TRL's metrics, per logged step (or of evaluate() with prefix "eval_"): token counts and accuracies are
    counts (exact in fp32 at these sizes), entropy a sum of fp32 terms in another order (1e-5 relative)."""
    for g, w in zip(got, want):
        for key in ("num_tokens", "mean_token_accuracy", "entropy"):
            if prefix + key not in w:
                continue
            exact = key != "entropy"
            g_value, w_value = g[prefix + key], w[prefix + key]
            assert (g_value == w_value) if exact else abs(g_value - w_value) <= 1e-5 * abs(w_value), \
                (what, prefix + key, g_value, w_value)


@pytest.mark.parametrize("padding_free", [False, True])
def test_trl_sft_trainer_equals_plain_data_parallelism(pool, padding_free):
    """TRL's own loss (its fused LM head on the shards' shift_labels), metrics (num_tokens, accuracy, entropy)
    and collators; right-padded rows, or padding-free rows (one packed row per micro-batch, documents from
    position_ids). With right-padded rows also TRL's evaluation, sequence-parallel, of 10 samples: the last
    eval step holds 2 real rows of 4 (accelerate pads the batch with the first rows and truncates after
    gathering). The reference is plain data parallelism on the same replicas (2 processes, eval batch 2),
    which the pool's plain run (4 processes of 1 row) stands for as follows:
      * eval_loss: the Trainer gathers one loss per row and drops the padding rows' (here both drop the
        same 2); TRL's eval loss is a process's mean over its own batch's targets, so a process of 2 rows
        and 2 processes of 1 row average the same numbers when every row has as many targets: the eval
        set's completions are all 16 tokens (prompts and widths still vary);
      * eval_entropy / eval_mean_token_accuracy: TRL gathers one sum per process and accelerate keeps the
        first `remainder` (2) values: plain on 2 replicas keeps both processes' sums, padding rows
        included; the pool's plain run keeps 2 rows. Its metrics over the eval set followed by the 2
        padding rows (no remainder: nothing dropped) are plain-on-2-replicas' metrics."""
    evaluated = 0 if padding_free else 10
    plain = plain_run(pool, 2, 0, run_sft, padding_free, False, evaluated, 48, evaluate_with_padding_rows)
    cases = [dict(strategy="zigzag", size=2)] + ([] if padding_free else [dict(strategy="ulysses", size=4)])
    for i, sp in enumerate(cases):
        what = f"SFTTrainer padding_free={padding_free} {sp}"
        got = pool.run(run_sft, ds_config(2, **sp), sp["size"], padding_free, False, evaluated if i == 0 else 0, 48,
                       evaluate_and_predict)[0]
        assert_same_training(what, got, plain)
        assert_same_trl_metrics(what, got[0], plain[0])
        if i == 0 and evaluated:
            (metrics, (logits, labels)), (ref, ref_padded, (ref_logits, ref_labels)) = got[2], plain[2]
            assert abs(metrics["eval_loss"] - ref["eval_loss"]) <= 1e-5 * ref["eval_loss"], (what, metrics, ref)
            assert {"eval_entropy", "eval_mean_token_accuracy"} <= set(ref_padded), ref_padded
            assert_same_trl_metrics(what, [metrics], [ref_padded], prefix="eval_")
            # predict(): full-length logits of every eval sample (batches pad to their own widths, -100 beyond)
            assert logits.shape[0] == ref_logits.shape[0] == evaluated, (logits.shape, ref_logits.shape)
            n = min(logits.shape[1], ref_logits.shape[1])
            assert not (ref_labels[:, n:] != -100).any(), f"{what}: logits cut short of real positions"
            real = ref_labels[:, :n] != -100
            assert real.any() and abs(logits[:, :n][real] - ref_logits[:, :n][real]).max() <= 1e-4, what
            assert (labels[:, :n][real] == ref_labels[:, :n][real]).all(), what


def run_resumed(cfg, micro, out, steps=4, stop=2):
    """On every rank: a run of ``steps`` that checkpoints at step ``stop`` (mid-epoch: 16 batches per
    replica and epoch, 6 consumed), then a new Trainer resumed from that checkpoint; ``out`` is one
    directory of every rank (DeepSpeed writes one ZeRO partition per rank). Rank 0 returns both."""
    example = _example()

    def train(name, **options):
        try:
            return example.train(cfg, os.path.join(out, name), max_steps=steps, gradient_accumulation_steps=3,
                                 per_device_train_batch_size=micro, **options)
        finally:
            reset_worker_state()

    whole = train("whole", save_steps=stop)
    resumed = train("resumed", resume_from_checkpoint=os.path.join(out, "whole", f"checkpoint-{stop}"))
    return whole, resumed


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_mid_epoch_continues_the_uninterrupted_run(pool, tmp_path, stage):
    """resume_from_checkpoint at step 2 of 4 (mid-epoch, gradient accumulation 3): the replicas skip
    the batches they had read (the re-sharded batch sampler survives accelerate's skip_first_batches),
    DeepSpeed reloads each rank's ZeRO partition and optimizer state, the Trainer each rank's RNG; the
    resumed steps 3-4 and the final parameters equal the uninterrupted run's bitwise (the same sums in
    the same order; resuming without the skip moves the step-3 loss by ~0.1)."""
    whole, resumed = pool.run(run_resumed, ds_config(stage, strategy="zigzag", size=2), 2, str(tmp_path))[0]
    assert [s["step"] for s in resumed[0]] == [1, 2, 3, 4], resumed[0]
    assert resumed[0] == whole[0], (f"ZeRO-{stage}: the resumed run's steps differ", resumed[0], whole[0])
    for name, want in whole[1].items():
        assert torch.equal(resumed[1][name], want), (f"ZeRO-{stage}: {name} differs after resuming",
                                                     (resumed[1][name] - want).abs().max().item())


@pytest.mark.parametrize("collator", ["flattening", "flattening_cu_seqlens"])
def test_flattening_collator_equals_plain_data_parallelism(pool, collator):
    """transformers' DataCollatorWithFlattening: a sequence-parallel micro-batch is one packed row of P
    samples (position_ids restarting per sample; with return_flash_attn_kwargs also cu_seq_lens_q/k);
    documents never attend across each other. Plain: the same collator at micro batch 1."""
    plain = pool.run(run_trainer, ds_config(2, strategy="zigzag", size=1), 1, 3, 0, collator=collator)[0]
    cases = [dict(strategy="zigzag", size=2)]
    if collator == "flattening":
        cases += [dict(strategy="ulysses", size=4)]
    for sp in cases:
        got = pool.run(run_trainer, ds_config(2, **sp), sp["size"], 3, 0, collator=collator)[0]
        assert_same_training(f"{collator} {sp}", got, plain)


def run_pretrained(cfg, micro, directory):
    """On every rank: a tiny model (seed 7, not the example's 0) saved by rank 0 outside any DeepSpeed
    context (save_pretrained writes on the main process only), then the example trained from_pretrained."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    from ds_seqpar import comm
    example = _example()
    unset_hf_deepspeed_config()        # an earlier run's ZeRO-3 arguments must not wrap this save in zero.Init
    path = os.path.join(directory, "tiny")
    if comm.global_rank() == 0 and not os.path.isdir(path):
        torch.manual_seed(7)
        example.tiny_model().save_pretrained(path)
    comm.barrier()
    import transformers
    load, partitioned = transformers.AutoModelForCausalLM.from_pretrained, []

    def recording(*args, **kwargs):
        model = load(*args, **kwargs)
        partitioned.append(all(hasattr(p, "ds_id") for p in model.parameters()))
        return model

    transformers.AutoModelForCausalLM.from_pretrained = recording
    try:
        result = run_trainer(cfg, micro, pretrained=path)
    finally:
        transformers.AutoModelForCausalLM.from_pretrained = load
    assert partitioned == [True], f"from_pretrained did not build the model under zero.Init: {partitioned}"
    return result


def test_from_pretrained_under_zero3_equals_plain_data_parallelism(pool, tmp_path):
    """TrainingArguments with a ZeRO-3 config made first, so transformers' from_pretrained builds the model
    under deepspeed.zero.Init (partitioned over every rank, the group DeepSpeed's engine then uses with
    sp.mpu) and loads the saved weights into the partitions; with the sequence_parallel key it trains
    equal to plain. Checked on every rank: the model came back partitioned (every parameter has a
    ds_id), and the loaded weights were used (step 1 differs from the from_config run, seed 0)."""
    plain = pool.run(run_pretrained, ds_config(3, strategy="zigzag", size=1), 1, str(tmp_path))[0]
    assert plain[0][0]["loss"] != plain_run(pool, 3)[0][0]["loss"], "from_pretrained did not load the saved weights"
    got = pool.run(run_pretrained, ds_config(3, strategy="zigzag", size=2), 2, str(tmp_path))[0]
    assert_same_training("from_pretrained ZeRO-3 zigzag P=2", got, plain)


def bad_batch_messages():
    """On every rank, the mixin's batch step (no Trainer needed) on batches a user's data can produce:
    a group whose ranks got batches of different lengths (one rank's padded 2 tokens longer: the same
    tokens otherwise), a collator without labels, left padding. Returns {case: message}."""
    from ds_seqpar import SequenceParallel, comm
    from ds_seqpar.hf.trainer import SequenceParallelMixin
    trainer = SequenceParallelMixin.__new__(SequenceParallelMixin)
    trainer.sp = SequenceParallel({"strategy": "zigzag", "size": 2})
    ids = torch.arange(3, 19).reshape(1, 16)
    out = {}

    def message(batch):
        try:
            trainer._shard_batch(batch)
        except Exception as err:
            return f"{type(err).__name__}: {err}"
        return "no error"

    longer = torch.nn.functional.pad(ids, (0, 2 * (trainer.sp.rank % 2)))
    out["length differs in a group"] = message({"input_ids": longer, "labels": longer})
    out["same batch"] = message({"input_ids": ids, "labels": ids})
    out["no labels"] = message({"input_ids": ids})
    mask = torch.ones_like(ids)
    mask[:, :2] = 0
    out["left padding"] = message({"input_ids": ids, "labels": ids, "attention_mask": mask})
    comm.barrier()
    return out


def test_bad_batches_are_refused_on_every_rank_with_the_fix(pool):
    expected = {"length differs in a group": "ConfigError: ds_seqpar.hf: the ranks of one sequence group got "
                "different batches", "same batch": "no error",
                "no labels": "ConfigError: ds_seqpar.hf: the data collator returned no labels",
                "left padding": "ConfigError: ds_seqpar.hf: a batch with left or inner padding"}
    results = pool.run(bad_batch_messages)
    for case, want in expected.items():
        messages = [r[case] for r in results]
        assert len(set(messages)) == 1, f"{case}: ranks disagree: {messages}"
        assert messages[0].startswith(want), f"{case}: {messages[0]!r} does not start with {want!r}"


def run_with_wandb(cfg, micro, directory):
    """On every rank: the example with report_to="none" and a DeepSpeed config whose "wandb" block is on
    (offline, runs under ``directory``); rank 0 returns the wandb run directories written, and the
    summary and config of the run active when training ended (read before it is finished)."""
    import glob
    import wandb
    from ds_seqpar import comm
    old = os.environ.get("WANDB_DIR")
    os.environ.update(WANDB_DIR=directory, WANDB_MODE="offline")
    active = None
    try:
        run_trainer(cfg, micro, steps=2, report_to="none")
        if wandb.run is not None:
            active = (dict(wandb.run.summary), dict(wandb.run.config))
    finally:
        if wandb.run is not None:
            wandb.finish()
        # wandb keeps the settings of its first run in the process (WANDB_DIR included): a later test on
        # these pool ranks must start from its own directory
        wandb.teardown()
        os.environ.pop("WANDB_DIR") if old is None else os.environ.update(WANDB_DIR=old)
    comm.barrier()
    if comm.global_rank() != 0:
        return None
    return sorted(glob.glob(os.path.join(directory, "wandb", "offline-run-*"))), active


def test_one_wandb_run_per_job_with_trainer_and_sp_metrics(pool, tmp_path):
    """DeepSpeed's "wandb" block on: one run (the Trainer's, although report_to="none" asked for none),
    with the Trainer's loss and the sp/* metrics and the sequence_parallel section in its config; no
    second run from DeepSpeed's monitor (which would log the engine's loss, scaled for the Trainer's
    token-count normalisation)."""
    cfg = ds_config(2, strategy="zigzag", size=2)
    cfg["wandb"] = {"enabled": True, "project": "ds_seqpar_test"}
    runs, active = pool.run(run_with_wandb, cfg, 2, str(tmp_path))[0]
    assert len(runs) == 1, f"{len(runs)} wandb runs for one job: {runs}"
    assert active is not None, "no wandb run was active after training"
    summary, config = active
    for key in ("train/loss", "train/grad_norm", "train/sp/size", "train/sp/comm_bytes", "train/sp/comm_seconds"):
        assert key in summary, (key, sorted(summary))
    assert summary["train/sp/size"] == 2 and summary["train/sp/comm_bytes"] > 0, summary
    assert config["sequence_parallel"]["strategy"] == "zigzag" and config["sequence_parallel"]["size"] == 2, config
    assert not any(k.startswith("Train/Samples") for k in summary), summary       # DeepSpeed's monitor keys


def test_gradient_accumulation_1_equals_plain_data_parallelism(pool):
    """Without accumulation every micro-batch is a step (the tests above use 3, not a multiple of P)."""
    plain = pool.run(run_trainer, ds_config(2, strategy="zigzag", size=1), 1, 4, 0, gradient_accumulation_steps=1)[0]
    for sp in (dict(strategy="zigzag", size=2), dict(strategy="ulysses", size=4)):
        got = pool.run(run_trainer, ds_config(2, **sp), sp["size"], 4, 0, gradient_accumulation_steps=1)[0]
        assert_same_training(f"accumulation 1 {sp}", got, plain)


def test_trl_bfd_packing_equals_plain_data_parallelism(pool):
    """TRL's packing (best-fit decreasing into rows of up to 96 tokens, padding-free): a sequence-parallel
    micro-batch of P packed rows becomes one row of documents; plain reads one packed row per micro-batch.
    Loss, grad_norm, learning rate, parameters, and TRL's per-micro-batch metrics: num_tokens (the whole
    rows' widths, not the shards' padded ones), mean_token_accuracy and entropy (sums over the group's
    shards, then over the replicas). 50 samples pack into 16 rows: no epoch leaves a remainder batch. (With
    one, accelerate keeps the first `remainder` per-process sums of the last batch: plain on the same 2
    replicas keeps both, padding rows included, the pool's 4 processes of 1 row keep only real rows; the
    mixin gives the former, as in the eval test above.)"""
    plain = pool.run(run_sft, ds_config(2, strategy="zigzag", size=1), 1, False, True, 0, 50)[0]
    got = pool.run(run_sft, ds_config(2, strategy="zigzag", size=2), 2, False, True, 0, 50)[0]
    assert_same_training("SFTTrainer BFD packing zigzag P=2", got, plain)
    assert all("num_tokens" in s and "entropy" in s for s in plain[0]), plain[0]
    assert_same_trl_metrics("SFTTrainer BFD packing zigzag P=2", got[0], plain[0])


def random_right_padding(rows):
    """Right padding (pad 0, label -100, an attention mask) to the longest row plus 0-3 more columns drawn
    from torch's generator: in a dataloader worker the draw follows the worker's seed. The extra pads
    change no loss (causal attention, pads last, their targets -100), only the batch's width."""
    return _example_pad_right()(rows, extra=int(torch.randint(0, 4, ())))


@functools.lru_cache(maxsize=None)
def _example_pad_right():
    return _example().pad_right


def run_with_workers(cfg, micro):
    """On every rank: the example with 2 dataloader workers and ``random_right_padding``; returns (rank 0's
    (steps, params), this rank's batches as (digest of input_ids, extra pad columns), in order)."""
    import multiprocessing
    from ds_seqpar.hf import trainer as module
    example = _example()
    example.COLLATORS["random_pad"] = lambda: random_right_padding
    seen, check = [], module.check_group_batch

    def recording(batch, sp):
        ids, mask = batch["input_ids"], batch["attention_mask"]
        seen.append((hash(tuple(ids.reshape(-1).tolist())), ids.shape[1] - int(mask.sum(1).max())))
        return check(batch, sp)

    # the pool's ranks are daemonic (they end with the test session), and multiprocessing refuses children
    # to a daemonic process: lifted for this run so that the DataLoader can start its (daemonic) workers.
    # They were also spawned, which makes spawn their default start method (each worker would import torch
    # and this module again: seconds on 2 cores); ranks started by a launcher fork their workers, as here.
    me, method = multiprocessing.current_process(), multiprocessing.get_start_method()
    daemon = me._config.get("daemon")
    me._config["daemon"], module.check_group_batch = False, recording
    multiprocessing.set_start_method("fork", force=True)
    try:
        with tempfile.TemporaryDirectory() as out:
            result = example.train(cfg, out, max_steps=2, gradient_accumulation_steps=3, collator="random_pad",
                                   per_device_train_batch_size=micro, dataloader_num_workers=2)
    finally:
        me._config["daemon"], module.check_group_batch = daemon, check
        multiprocessing.set_start_method(method, force=True)
        reset_worker_state()
    return result, seen


def test_dataloader_workers_seeded_per_replica_give_a_group_identical_batches(pool):
    """A shuffled dataset read by 2 dataloader workers per rank, with a collator that draws each batch's
    extra right padding in the worker: the mixin seeds the workers by replica (the Trainer seeds them by
    world rank), so the 2 ranks of a group draw the same widths and hold identical batches (recorded at
    the mixin's batch check, which would stop the run otherwise), the 2 replicas read different batches,
    and the run equals plain data parallelism with the same 2 workers per process."""
    plain = pool.run(run_with_workers, ds_config(2, strategy="zigzag", size=1), 1)[0][0]
    results = pool.run(run_with_workers, ds_config(2, strategy="zigzag", size=2), 2)
    assert_same_training("dataloader_num_workers=2 zigzag P=2", results[0][0], plain)
    batches = [seen for _, seen in results]
    assert len(batches[0]) == 6 and batches[0] == batches[1] and batches[2] == batches[3], batches
    assert all(a[0] != b[0] for a, b in zip(batches[0], batches[2])), "the replicas read the same batches"
    assert len({extra for _, extra in batches[0] + batches[2]}) > 1, "the collator drew no extra padding"
