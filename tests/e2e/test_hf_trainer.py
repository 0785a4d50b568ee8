"""examples/hf_trainer.py as a user starts it: ``deepspeed --num_gpus 4 examples/hf_trainer.py --deepspeed
configs/trainer/zigzag_zero2.json`` (2 data x 2 sequence ranks, ZeRO-2, gradient accumulation 3,
variable-length samples with -100 prompt masks, right padding). Its logged loss, grad_norm and
learning_rate per step and its final parameters equal plain data parallelism on the same 4 ranks
(size 1, micro batch 1: the same samples per step, see tests/dist/test_hf_trainer.py), run on the
pool. One launcher run: starting 4 processes that import transformers and DeepSpeed is the slow part.

Tolerance: fp32 runs that differ only in the order of sums (attention merged over ranks, the loss
summed over shards, gradients reduced in another grouping); observed: the loss bitwise equal,
grad_norm within 1e-7 relative, parameters within 1.4e-7 at values ~1. The bounds (1e-5) are 100x
that and far below what a wrong normalisation, a lost block or a replica reading the wrong data
moves (>= 1e-3 relative on the loss)."""
import json
import os

import pytest
import torch

from ds_seqpar.launch.env import free_port

from ..dist.test_hf_trainer import assert_same_training, plain_run
from .test_launchers import ROOT, run

pytestmark = pytest.mark.launcher


def test_example_under_the_deepspeed_launcher_equals_plain_data_parallelism(pool, tmp_path):
    out = tmp_path / "zigzag"
    cmd = ["deepspeed", "--num_gpus", "4", "--master_port", str(free_port()), "examples/hf_trainer.py",
           "--deepspeed", os.path.join(ROOT, "configs", "trainer", "zigzag_zero2.json"), "--output_dir", str(out),
           "--max_steps", "3"]
    code, log = run(cmd, timeout=400)
    assert code == 0, f"exit {code}\n{log[-4000:]}"
    assert "'sp/size': 2" in log, "no sequence-parallel metrics were logged"
    with open(out / "steps.json") as f:
        got = (json.load(f), torch.load(out / "final.pt"))
    plain = plain_run(pool, 2, 10)              # the run tests/dist/test_hf_trainer.py compares against
    assert_same_training("deepspeed launcher, zigzag dp2 x sp2", got, plain)
