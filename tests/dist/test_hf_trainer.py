"""SequenceParallelTrainer on the 4-rank pool against plain data parallelism on the same 4 ranks.

Plain: size 1, 4 replicas, micro batch 1. Sequence parallel: size P, 4/P replicas, micro batch P.
Every optimizer step then covers the same samples (the Trainer's sampler permutes indices the same
way for any batch size; replica d of a run with micro batch m reads batches d, d + dp, ...), and
the loss is the mean over the same tokens, so the logged loss, grad_norm and learning_rate per step
and the final parameters must agree: gradient accumulation 3 (not a multiple of P), variable-length
samples with -100 prompt masks, right padding in the sequence-parallel runs only, ZeRO 1/2/3.
Tolerance: fp32 runs that differ only in the order of sums; 100x the few ulps observed (module doc of
tests/e2e/test_hf_trainer.py)."""
import importlib.util
import json
import os
import tempfile

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))


def _example():
    spec = importlib.util.spec_from_file_location("hf_trainer_example", os.path.join(ROOT, "examples", "hf_trainer.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ds_config(stage, **sequence_parallel):
    with open(os.path.join(ROOT, "configs", "trainer", "zigzag_zero2.json")) as f:
        cfg = json.load(f)
    cfg["zero_optimization"]["stage"] = stage
    cfg["sequence_parallel"] = sequence_parallel
    return cfg


def run_trainer(cfg, micro, steps=3, eval_samples=0):
    """On every rank: one Trainer run; rank 0 returns (steps, params[, (eval_loss, logits, labels)])."""
    from accelerate.state import AcceleratorState, PartialState
    example = _example()
    with tempfile.TemporaryDirectory() as out:
        try:
            return example.train(cfg, out, max_steps=steps, gradient_accumulation_steps=3,
                                 per_device_train_batch_size=micro, eval_samples=eval_samples)
        finally:
            AcceleratorState._reset_state(reset_partial_state=False)
            PartialState._reset_state()


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
    plain = pool.run(run_trainer, ds_config(stage, strategy="zigzag", size=1), 1)[0]
    cases = [dict(strategy="zigzag", size=2), dict(strategy="ulysses", size=4)]
    if stage == 2:
        cases += [dict(strategy="ring", size=2), dict(strategy="striped", size=4, ulysses_size=2)]
    for sp in cases:
        got = pool.run(run_trainer, ds_config(stage, **sp), sp["size"])[0]
        assert_same_training(f"ZeRO-{stage} {sp}", got, plain)


def test_eval_and_predict_equal_plain_data_parallelism(pool):
    """10 eval samples: the last eval step holds 2 real samples of 4 (accelerate pads with the first
    samples again and truncates after the gather); eval runs sequence-parallel, predict() returns
    full-length logits and the collator's labels. Two replicas of 2 and four plain processes of 1 pad
    the last step with the same samples, and the Trainer normalises each step's loss by the tokens of
    the padded step, so the eval_loss of plain data parallelism depends on the replica count: the
    sequence-parallel runs here have 2 replicas, matched by the plain run's padding."""
    import numpy as np
    plain = pool.run(run_trainer, ds_config(2, strategy="zigzag", size=1), 1, 1, 10)[0]
    for sp in (dict(strategy="zigzag", size=2), dict(strategy="ulysses", size=2)):
        got = pool.run(run_trainer, ds_config(2, **sp), sp["size"], 1, 10)[0]
        assert_same_training(f"eval run {sp}", got, plain)
        (loss, logits, labels), (ref_loss, ref_logits, ref_labels) = got[2], plain[2]
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (sp, loss, ref_loss)
        assert logits.shape[0] == ref_logits.shape[0] == 10, (logits.shape, ref_logits.shape)
        n = min(logits.shape[1], ref_logits.shape[1])      # batches pad to their own widths (-100 beyond)
        real = ref_labels[:, :n] != -100
        assert np.abs(logits[:, :n][real] - ref_logits[:, :n][real]).max() <= 1e-4, sp
        assert (labels[:, :n][real] == ref_labels[:, :n][real]).all(), sp
