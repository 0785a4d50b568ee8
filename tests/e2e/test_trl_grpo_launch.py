"""examples/trl_grpo.py as a user starts it: ``deepspeed --num_gpus 4 examples/trl_grpo.py --deepspeed
configs/trainer/zigzag_zero2.json`` (2 data x 2 sequence ranks, ZeRO-2). Its logged metrics (completion lengths,
rewards, loss, grad_norm, entropy, clip ratios) and its parameter updates equal plain data parallelism with 2
processes, run on the 2-rank pool (tests/dist/test_trl_grpo.py: the same comparison and tolerances). One launcher
run."""
import json
import os

import pytest
import torch

from ds_seqpar.launch.env import free_port

from ..dist.test_trl_grpo import assert_same_grpo, plain
from .test_launchers import ROOT, run

pytestmark = pytest.mark.launcher


def test_grpo_example_under_the_deepspeed_launcher_equals_plain_data_parallelism(pool2, tmp_path):
    out = tmp_path / "grpo"
    cmd = ["deepspeed", "--num_gpus", "4", "--master_port", str(free_port()), "examples/trl_grpo.py",
           "--deepspeed", os.path.join(ROOT, "configs", "trainer", "zigzag_zero2.json"), "--output_dir", str(out),
           "--max_steps", "2"]
    code, log = run(cmd, timeout=400)
    assert code == 0, f"exit {code}\n{log[-4000:]}"
    with open(out / "steps.json") as f:
        got = (json.load(f), torch.load(out / "final.pt"))
    assert all(s["sp/size"] == 2 for s in got[0]), "the steps did not run sequence-parallel"
    assert_same_grpo("deepspeed launcher, GRPO zigzag dp2 x sp2", got, plain(pool2, 2))
