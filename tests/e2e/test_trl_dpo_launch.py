"""examples/trl_dpo.py as a user starts it: ``deepspeed --num_gpus 4 examples/trl_dpo.py --deepspeed
configs/trainer/zigzag_zero2.json`` (2 data x 2 sequence ranks, ZeRO-2, 2 pairs per micro-batch, gradient
accumulation 3). Its logged loss, grad_norm, every DPO metric and its final parameters equal plain data
parallelism on the same 4 ranks, run on the pool (tests/dist/test_trl_dpo.py: the same comparison and
tolerances). One launcher run."""
import json
import os

import pytest
import torch

from ds_seqpar.launch.env import free_port

from ..dist.test_trl_dpo import EVAL, assert_same_dpo, plain
from .test_launchers import ROOT, run

pytestmark = pytest.mark.launcher


def test_dpo_example_under_the_deepspeed_launcher_equals_plain_data_parallelism(pool, tmp_path):
    out = tmp_path / "dpo"
    cmd = ["deepspeed", "--num_gpus", "4", "--master_port", str(free_port()), "examples/trl_dpo.py",
           "--deepspeed", os.path.join(ROOT, "configs", "trainer", "zigzag_zero2.json"), "--output_dir", str(out),
           "--max_steps", "3"]
    code, log = run(cmd, timeout=400)
    assert code == 0, f"exit {code}\n{log[-4000:]}"
    with open(out / "steps.json") as f:
        got = (json.load(f), torch.load(out / "final.pt"))
    assert all(s["sp/size"] == 2 for s in got[0]), "the steps did not run sequence-parallel"
    assert_same_dpo("deepspeed launcher, DPO zigzag dp2 x sp2", got, plain(pool, 2, eval_samples=EVAL))   # the pool test's run: training does not see the eval
