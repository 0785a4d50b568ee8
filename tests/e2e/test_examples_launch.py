"""examples/trl_dpo.py, trl_grpo.py and hf_trainer.py as a user starts them: ``deepspeed --num_gpus 4
examples/X.py --deepspeed configs/trainer/zigzag_zero2.json`` (2 data x 2 sequence ranks, ZeRO-2), the three in
one launch (tests/e2e/examples_launch.py runs each script's main() in turn in the same 4 processes: starting
them is most of a launch). Each one's logged metrics and final parameters equal plain data parallelism run on
the pool, with the comparisons and tolerances of its pool test:

* DPO (2 pairs per micro-batch, gradient accumulation 3): loss, grad_norm, every DPO metric
  (tests/dist/test_trl_dpo.py);
* GRPO: completion lengths, rewards, loss, grad_norm, entropy, clip ratios and the parameter updates, against
  plain data parallelism with 2 processes on the 2-rank pool (tests/dist/test_trl_grpo.py);
* the Trainer (gradient accumulation 3, variable-length samples with -100 prompt masks, right padding): loss,
  grad_norm and learning_rate per step (tests/dist/test_hf_trainer.py). fp32 runs that differ only in the
  order of sums: observed the loss bitwise equal, grad_norm within 1e-7 relative, parameters within 1.4e-7
  at values ~1; the bounds (1e-5) are 100x that and far below what a wrong normalisation, a lost block or a
  replica reading the wrong data moves (>= 1e-3 relative on the loss)."""
import json
import os

import pytest
import torch

from ds_seqpar.launch.env import free_port

from ..dist import test_hf_trainer, test_trl_dpo, test_trl_grpo
from .test_launchers import ROOT, run

pytestmark = pytest.mark.launcher
CONFIG = os.path.join(ROOT, "configs", "trainer", "zigzag_zero2.json")
# in launch order: hf_trainer.py tears the process group down at its end, so it goes last
EXAMPLES = {"trl_dpo": ["--max_steps", "3"], "trl_grpo": ["--max_steps", "2"], "hf_trainer": ["--max_steps", "3"]}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """(output directory, launch log) of the one launch."""
    out = tmp_path_factory.mktemp("examples")
    cmd = ["deepspeed", "--num_gpus", "4", "--master_port", str(free_port()), "tests/e2e/examples_launch.py"]
    for i, (name, args) in enumerate(EXAMPLES.items()):
        cmd += ["--then"] * bool(i) + [f"examples/{name}.py", "--deepspeed", CONFIG, "--output_dir", str(out / name),
                                       *args]
    code, log = run(cmd, timeout=600)
    assert code == 0, f"exit {code}\n{log[-4000:]}"
    return out, log


def outputs(out, name):
    with open(out / name / "steps.json") as f:
        return json.load(f), torch.load(out / name / "final.pt")


def test_dpo_example_under_the_deepspeed_launcher_equals_plain_data_parallelism(launched, pool):
    got = outputs(launched[0], "trl_dpo")
    assert all(s["sp/size"] == 2 for s in got[0]), "the steps did not run sequence-parallel"
    # the pool test's run: training does not see the eval
    want = test_trl_dpo.plain(pool, 2, eval_samples=test_trl_dpo.EVAL)
    test_trl_dpo.assert_same_dpo("deepspeed launcher, DPO zigzag dp2 x sp2", got, want)


def test_grpo_example_under_the_deepspeed_launcher_equals_plain_data_parallelism(launched, pool2):
    got = outputs(launched[0], "trl_grpo")
    assert all(s["sp/size"] == 2 for s in got[0]), "the steps did not run sequence-parallel"
    test_trl_grpo.assert_same_grpo("deepspeed launcher, GRPO zigzag dp2 x sp2", got, test_trl_grpo.plain(pool2, 2))


def test_trainer_example_under_the_deepspeed_launcher_equals_plain_data_parallelism(launched, pool):
    assert "'sp/size': 2" in launched[1], "no sequence-parallel metrics were logged"
    got = outputs(launched[0], "hf_trainer")
    plain = test_hf_trainer.plain_run(pool, 2, 10)      # the run tests/dist/test_hf_trainer.py compares against
    test_hf_trainer.assert_same_training("deepspeed launcher, zigzag dp2 x sp2", got, plain)
