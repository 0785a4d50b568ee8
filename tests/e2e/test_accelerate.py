"""``accelerate launch`` with the DeepSpeed JSON named in accelerate's YAML (deepspeed_config_file), not
passed to the script: SequenceParallelTrainer takes the strategy from that JSON (hf/ds_config.py).
One real launch of examples/hf_trainer.py on 2 CPU ranks (1 data x 2 sequence, zigzag), 2 steps."""
import json
import os
import shutil

import pytest
import yaml

from .test_launchers import ROOT, run

pytestmark = [pytest.mark.launcher,
              pytest.mark.skipif(shutil.which("accelerate") is None, reason="accelerate not on PATH")]


def test_accelerate_launch_reads_sequence_parallel_from_its_deepspeed_config_file(tmp_path):
    with open(os.path.join(ROOT, "configs", "trainer", "accelerate_zigzag.yaml")) as f:
        acc = yaml.safe_load(f)
    acc.update(num_processes=2, use_cpu=True)
    ds = acc["deepspeed_config"]
    ds["deepspeed_config_file"] = os.path.join(ROOT, ds["deepspeed_config_file"])
    (tmp_path / "acc.yaml").write_text(yaml.safe_dump(acc))
    out = tmp_path / "out"
    code, log = run(["accelerate", "launch", "--config_file", str(tmp_path / "acc.yaml"), "examples/hf_trainer.py",
                     "--output_dir", str(out), "--max_steps", "2", "--samples", "16"], timeout=400)
    assert code == 0, log[-4000:]
    assert log.count("'sp/size': 2") == 2, log[-4000:]           # both steps ran sequence-parallel
    with open(out / "steps.json") as f:
        assert [s["step"] for s in json.load(f)] == [1, 2]
