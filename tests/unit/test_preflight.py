"""The main job's front door (train/preflight.py): a bad config or option is found before torch
loads, each message names only what is wrong, and under a launcher rank 0 alone says it."""
import json
import os
import subprocess
import sys

import pytest

from ds_seqpar.config import ConfigError, read_json
from ds_seqpar.train.args import build_parser
from ds_seqpar.train.preflight import check_config, reports_errors

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))

# the front door as ``python -m ds_seqpar.train`` runs it, reporting what it had imported when it exited
PROBE = """
import runpy, sys
sys.argv = ["ds_seqpar.train"] + sys.argv[1:]
try:
    runpy.run_module("ds_seqpar.train", run_name="__main__", alter_sys=True)
except SystemExit as done:
    print("EXIT", done.code, sorted(m for m in ("torch", "deepspeed", "transformers") if m in sys.modules))
"""


def front_door(*argv, **env):
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, PYTHONPATH=ROOT, **env))
    return proc.stdout, proc.stderr


def opts(*argv):
    return build_parser().parse_args(list(argv))


def test_a_bad_strategy_is_said_before_torch_loads_with_the_nearest_name():
    out, err = front_door("--strategy", "stripe")
    assert out.strip() == "EXIT 2 []", (out, err)
    assert err.strip() == ("ds_seqpar.train: error: sequence_parallel.strategy='stripe' is not valid (did you mean "
                           "'striped'?); choose one of: ulysses, ring, zigzag, striped, lasp"), err


def test_under_a_launcher_only_rank_0_says_it_and_every_rank_exits_2():
    ranks = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "WORLD_SIZE": "2"}
    said = [front_door("--seq_len", "0", RANK=str(r), LOCAL_RANK=str(r), **ranks) for r in (0, 1)]
    assert [out.strip() for out, _ in said] == ["EXIT 2 []"] * 2, said
    assert said[0][1].startswith("ds_seqpar.train: error: --seq_len=0"), said[0][1]
    assert said[1][1] == "", said[1][1]


@pytest.mark.parametrize("env,says", [
    ({}, True),                                                              # no launcher: the one process
    ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "h"}, True),
    ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "h"}, False),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, False),                            # mpirun: node 1's first rank
    ({"RANK": "1"}, True),                                                   # unreadable launcher: all say it
])
def test_rank_0_of_the_job_reports(env, says):
    assert reports_errors(env) is says


def test_seq_len_error_names_only_seq_len():
    with pytest.raises(ConfigError) as err:
        check_config(opts("--seq_len", "0"), None)
    assert "--seq_len=0" in str(err.value) and "--steps" not in str(err.value), err.value
    with pytest.raises(ConfigError) as err:
        check_config(opts("--steps", "-1"), None)
    assert str(err.value) == "--steps=-1 must be >= 0"


def test_world_size_is_checked_against_the_launch():
    check_config(opts("--sp_size", "2"), 4)
    with pytest.raises(ConfigError, match="size=3 does not divide the world size 4"):
        check_config(opts("--sp_size", "3"), 4)


README_BLOCK = """{
  "train_micro_batch_size_per_gpu": 1,
  "sequence_parallel": {
    "strategy": "striped",      // ulysses | ring | zigzag | striped | lasp
    "size": 4
  }
}
"""


def test_a_commented_config_names_file_line_column_and_the_comment(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(README_BLOCK)
    with pytest.raises(ConfigError) as err:
        check_config(opts("--deepspeed_config", str(path)), None)
    first = str(err.value).splitlines()[0]
    assert first.startswith(f"{path}:4:33: not valid JSON: "), first
    assert first.endswith("JSON has no comments: remove the // or /* */ comment"), first
    assert str(err.value).splitlines()[1].strip().startswith('"strategy": "striped",      //'), err.value


def test_other_syntax_errors_get_no_comment_hint(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"sequence_parallel": {"strategy": "http://striped"},\n}')   # // inside a string
    with pytest.raises(ConfigError) as err:
        read_json(str(path))
    assert str(err.value).startswith(f"{path}:2:1: not valid JSON") and "comment" not in str(err.value), err.value
    path.write_text(json.dumps({"sequence_parallel": {"strategy": "ring"}}))
    assert read_json(str(path)) == {"sequence_parallel": {"strategy": "ring"}}


def test_the_trainers_auto_values_are_filled_and_any_other_auto_is_refused_by_its_key(tmp_path):
    """One JSON for both entry points: the Trainer example's config ("auto" everywhere the Trainer's
    arguments own a value) runs in the main job with the job's defaults; --lr still overrides."""
    from ds_seqpar.train.args import DEFAULT_DS_CONFIG
    ds, _ = check_config(opts("--deepspeed_config", os.path.join(ROOT, "configs/trainer/zigzag_zero2.json")), 4)
    assert ds["train_micro_batch_size_per_gpu"] == DEFAULT_DS_CONFIG["train_micro_batch_size_per_gpu"]
    assert ds["optimizer"]["params"]["betas"] == DEFAULT_DS_CONFIG["optimizer"]["params"]["betas"]
    assert ds["gradient_clipping"] == 1.0 and "auto" not in json.dumps(ds)
    ds, _ = check_config(opts("--deepspeed_config", os.path.join(ROOT, "configs/trainer/zigzag_zero2.json"),
                              "--lr", "3e-4"), 4)
    assert ds["optimizer"]["params"]["lr"] == 3e-4
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"},
                               "sequence_parallel": {"strategy": "ring", "size": 2}}))
    with pytest.raises(ConfigError, match=r'"zero_optimization.stage3_prefetch_bucket_size": "auto" is filled by '
                                          r"transformers' Trainer.*give zero_optimization.stage3_prefetch_bucket_size"):
        check_config(opts("--deepspeed_config", str(bad)), 4)


def test_lr_moves_a_warmup_schedulers_bounds_with_it():
    """Under WarmupLR the scheduler writes the lr at every step: --lr must reach its bounds, or it would
    change nothing (the peak becomes --lr, the floor keeps its ratio to the peak)."""
    ds, _ = check_config(opts("--deepspeed_config", os.path.join(ROOT, "configs/zigzag_zero2.json"), "--lr", "1e-2"), 4)
    params = ds["scheduler"]["params"]
    assert ds["optimizer"]["params"]["lr"] == params["warmup_max_lr"] == 1e-2
    assert params["warmup_min_lr"] == pytest.approx(1e-3) and params["warmup_num_steps"] == 10
    ds, _ = check_config(opts("--deepspeed_config", os.path.join(ROOT, "configs/zigzag_zero2.json")), 4)
    assert ds["scheduler"]["params"]["warmup_max_lr"] == 1e-3


def test_batch_keys_under_lengths_are_filled_or_refused_by_name(tmp_path):
    """--lengths: the tokens per step define the batch; a JSON without DeepSpeed's batch keys runs (the micro
    batch filled), a train_batch_size is refused by name; without --lengths a JSON without either key is
    refused with what to write; a bad value is refused by its key. Never DeepSpeed's bare assertion."""
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("30\n50\n")
    cfg = tmp_path / "ds.json"

    def with_json(section, *argv):
        cfg.write_text(json.dumps(dict(section, sequence_parallel={"strategy": "zigzag", "size": 2})))
        return check_config(opts("--deepspeed_config", str(cfg), *argv), 2)[0]

    for size in ("2", "dynamic"):
        extra = ("--sp_size", size) + (("--max_tokens_per_rank", "64") if size == "dynamic" else ())
        ds = with_json({"zero_optimization": {"stage": 2}}, "--lengths", str(lengths), *extra)
        assert ds["train_micro_batch_size_per_gpu"] == 1 and "train_batch_size" not in ds
        with pytest.raises(ConfigError, match=r'"train_batch_size": 8 with --lengths.*remove train_batch_size'):
            with_json({"train_batch_size": 8}, "--lengths", str(lengths), *extra)
    with pytest.raises(ConfigError, match=r'neither "train_micro_batch_size_per_gpu" nor "train_batch_size".*'
                                          r'--micro_batch 2'):
        with_json({"zero_optimization": {"stage": 2}})
    assert with_json({"train_batch_size": 8})["train_batch_size"] == 8
    for key, bad in (("train_micro_batch_size_per_gpu", 0), ("gradient_accumulation_steps", "2"),
                     ("train_batch_size", 1.5)):
        with pytest.raises(ConfigError, match=f'"{key}": {bad!r} is not a whole number >= 1'):
            with_json({key: bad})


BAD_OPTIONS = [("--micro_batch", "0"), ("--lr", "-1"), ("--lr", "nan"), ("--max_tokens_per_rank", "0"),
               ("--ulysses_size", "0"), ("--dim", "0"), ("--n_layers", "0"), ("--n_heads", "0"), ("--n_kv_heads", "0"),
               ("--mlp_hidden", "0"), ("--vocab_size", "1"), ("--corpus_bytes", "0"), ("--ignore_frac", "1.5"),
               ("--ignore_frac", "-0.1"), ("--tokens_per_step", "0"), ("--images", "-1"), ("--save_interval", "-1"),
               ("--master_port", "0"), ("--steps", "-1"), ("--seq_len", "1"), ("--nprocs", "0")]
BAD_KEYS = [({"zero_optimization": {"stage": 7}}, "zero_optimization.stage"),
            ({"zero_optimization": {"stage": "2"}}, "zero_optimization.stage"),
            ({"zero_optimization": "x"}, "zero_optimization"), ({"gradient_clipping": "x"}, "gradient_clipping"),
            ({"gradient_clipping": -1}, "gradient_clipping"), ({"optimizer": {"params": {"lr": "x"}}},
                                                                "optimizer.params.lr"),
            ({"optimizer": {"params": {"lr": -1}}}, "optimizer.params.lr"),
            ({"bf16": {"enabled": "yes"}}, "bf16.enabled"),
            ({"fp16": {"enabled": 1}}, "fp16.enabled"), ({"steps_per_print": 0}, "steps_per_print"),
            ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "x"}}}, "scheduler.params.warmup_max_lr"),
            ({"wandb": {"enabled": "x"}}, "wandb.enabled"), ({"checkpoint": 5}, "checkpoint"),
            ({"train_micro_batch_size_per_gpu": True}, "train_micro_batch_size_per_gpu"),
            ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps")]


def test_the_sweep_of_bad_options_and_keys_ends_in_the_jobs_own_message(tmp_path):
    """Every out-of-range option and every mistyped or out-of-range DeepSpeed key the job reads is refused by
    the front door (before torch, before DeepSpeed) with a message naming that option or key: never
    DeepSpeed's pydantic error or assertion, never a torch error on every rank."""
    for option, value in BAD_OPTIONS:
        with pytest.raises(ConfigError) as err:
            check_config(opts(option, value), 4)
        assert option.lstrip("-") in str(err.value), (option, value, str(err.value))
    base = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "sequence_parallel": {"strategy": "zigzag", "size": 2}}
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(base))
    check_config(opts("--deepspeed_config", str(cfg)), 4)         # the base is good
    for change, key in BAD_KEYS:
        bad = json.loads(json.dumps(base))
        for k, v in change.items():
            if isinstance(v, dict) and isinstance(bad.get(k), dict):
                bad[k].update(v)
            else:
                bad[k] = v
        cfg.write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=f'DeepSpeed config "{key}"'):
            check_config(opts("--deepspeed_config", str(cfg)), 4)
