"""Options of the main job: one argparse parser serves the command line and ``run_training(dict)``
(a dict is checked against the parser's options, so a test cannot pass a misspelt key silently)."""
from __future__ import annotations

import argparse
from typing import Any, Mapping

from ..config import ConfigError

# What `python -m ds_seqpar.train` uses without --deepspeed_config: configs/zigzag_zero2.json
# (kept identical; tests/unit/test_train_units.py checks). Built in so an installed package runs too.
DEFAULT_DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "steps_per_print": 1000000,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                              "weight_decay": 0.01, "torch_adam": True}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3,
                                                 "warmup_num_steps": 10, "warmup_type": "linear"}},
    "zero_optimization": {"stage": 2, "overlap_comm": False, "contiguous_gradients": True},
    "sequence_parallel": {"strategy": "zigzag", "size": 2},
    "wandb": {"enabled": True, "project": "ds_seqpar"},
}


class TrainConfigError(ConfigError):
    """A bad training option found before training starts (same message on every rank)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds_seqpar.train", description="Train a small causal LM with sequence "
                                "parallelism x ZeRO data parallelism (CPU gloo or GPU nccl).")
    g = p.add_argument_group("DeepSpeed and parallelism")
    g.add_argument("--deepspeed_config", default=None, help="DeepSpeed JSON with a 'sequence_parallel' key "
                   "(default: built-in zigzag, size 2, ZeRO-2 = configs/zigzag_zero2.json)")
    g.add_argument("--strategy", default=None, help="override sequence_parallel.strategy")
    g.add_argument("--sp_size", type=_size, default=None, help="override sequence_parallel.size (an integer, or "
                   "'dynamic' with --max_tokens_per_rank: docs/dynamic.md)")
    g.add_argument("--max_tokens_per_rank", type=int, default=None,
                   help="override sequence_parallel.max_tokens_per_rank (with size 'dynamic')")
    g.add_argument("--ulysses_size", type=int, default=None, help="override sequence_parallel.ulysses_size")
    g.add_argument("--zero_stage", type=int, default=None, choices=(0, 1, 2, 3), help="override ZeRO stage")
    g.add_argument("--micro_batch", type=int, default=None, help="override train_micro_batch_size_per_gpu")
    g.add_argument("--lr", type=float, default=None, help="override the optimizer's lr; a WarmupLR / WarmupDecayLR / "
                   "OneCycle scheduler's bounds move with it (the peak becomes LR)")
    g.add_argument("--nprocs", type=int, default=4, help="ranks to start when no launcher started this "
                   "command (ignored under deepspeed/torchrun/mpirun)")
    g.add_argument("--master_port", type=int, default=29500, help="rendezvous port where the launcher sets "
                   "no MASTER_PORT (mpirun, srun, one process)")
    # what the deepspeed launcher and deepspeed-style scripts pass; the environment carries the rank
    g.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    g.add_argument("--deepspeed", action="store_true", help=argparse.SUPPRESS)
    m = p.add_argument_group("model")
    m.add_argument("--model", default=None, metavar="PATH", help="train a local Hugging Face causal LM instead of "
                   "the built-in one: a model directory (config.json + weights: from_pretrained) or a config JSON / "
                   "directory without weights (random init); the options below are then ignored")
    m.add_argument("--dim", type=int, default=128)
    m.add_argument("--n_layers", type=int, default=4)
    m.add_argument("--n_heads", type=int, default=4)
    m.add_argument("--n_kv_heads", type=int, default=None, help="fewer k/v heads than q heads: GQA")
    m.add_argument("--mlp_hidden", type=int, default=None)
    m.add_argument("--attention", default="auto", choices=("auto", "softmax", "linear"),
                   help="auto: linear for strategy lasp, softmax otherwise")
    m.add_argument("--untied", action="store_true", help="separate lm head instead of the embedding's")
    m.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   choices=("inductor", "aot_eager", "eager"),
                   help="torch.compile the model (DeepSpeed's engine.compile); BACKEND: inductor (the default), "
                        "aot_eager, eager; sequence lengths are marked dynamic, so new lengths and packings do not "
                        "recompile every step")
    d = p.add_argument_group("data and steps")
    d.add_argument("--steps", type=int, default=50, help="total optimizer steps (a resumed run stops here too)")
    d.add_argument("--seq_len", type=int, default=512, help="global sequence length")
    d.add_argument("--data", default=None, help="token file (.bin of uint16/uint32); default: a byte-level "
                   "corpus of this Python's standard library sources")
    d.add_argument("--data_dtype", default="uint16", choices=("uint16", "uint32"))
    d.add_argument("--vocab_size", type=int, default=None, help="token files: default max id + 1")
    d.add_argument("--corpus_bytes", type=int, default=4 << 20, help="size of the embedded corpus")
    d.add_argument("--ignore_frac", type=float, default=0.0, help="fraction of labels set to -100")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--lengths", default=None, metavar="FILE", help="document lengths, one integer per line (.gz too): "
                   "each step draws documents with lengths sampled from FILE and contents from the data, until "
                   "--tokens_per_step; the loss is the token-level mean of the step's documents (docs/dynamic.md)")
    d.add_argument("--tokens_per_step", type=int, default=None, help="with --lengths: tokens per optimizer step "
                   "(default: --seq_len x replicas)")
    d.add_argument("--images", type=int, default=0, metavar="N", help="a vision-language --model (Qwen-VL-style "
                   "grid models): N random images per row, their placeholders at evenly spaced places "
                   "(docs/hf.md)")
    d.add_argument("--image_grid", default="1,8,8", metavar="T,H,W", help="with --images: each image's grid in "
                   "patches (t*h*w / spatial_merge_size^2 placeholders)")
    lg = p.add_argument_group("logging and checkpoints")
    lg.add_argument("--run_dir", default="runs", help="runs/<name>/metrics.jsonl, run.json, wandb/")
    lg.add_argument("--run_name", default=None)
    lg.add_argument("--no_wandb", action="store_true", help="ignore the config's wandb block")
    lg.add_argument("--no_progress", dest="progress", action="store_false", help="no progress bar")
    lg.add_argument("--quiet", action="store_true", help="no progress bar, no messages (errors still print)")
    lg.add_argument("--verbose", action="store_true", help="keep DeepSpeed's INFO logging")
    lg.add_argument("--save_dir", default=None, help="DeepSpeed checkpoints go here")
    lg.add_argument("--save_interval", type=int, default=0, help="save every K steps (0: never)")
    lg.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save_dir "
                    "(under torchrun --max-restarts a first start, with none yet, starts at step 0)")
    lg.add_argument("--resume_tag", default=None, help="continue from this tag (e.g. step20) in --save_dir")
    lg.add_argument("--resume_universal", action="store_true", help="continue from the latest (or --resume_tag) "
                    "checkpoint at another shape: other data-parallel or sequence-parallel size or strategy, "
                    "same ZeRO stage (converted once to DeepSpeed's universal checkpoint, <tag>_universal)")
    return p


def _size(text: str):
    """--sp_size: an integer or the word dynamic."""
    return text if text == "dynamic" else int(text)


def resolve_args(args: Mapping[str, Any]) -> argparse.Namespace:
    """Defaults of the parser overlaid with ``args``; unknown keys are an error."""
    opts = build_parser().parse_args([])
    unknown = sorted(set(args) - set(vars(opts)))
    if unknown:
        raise TrainConfigError(f"unknown training options {unknown}; known: {', '.join(sorted(vars(opts)))}")
    for k, v in args.items():
        setattr(opts, k, v)
    if opts.quiet:
        opts.progress = False
    return opts




def parse_grid(text: str) -> tuple:
    """--image_grid T,H,W (patches)."""
    try:
        grid = tuple(int(v) for v in str(text).split(","))
    except ValueError:
        grid = ()
    if len(grid) != 3 or min(grid) < 1:
        raise TrainConfigError(f"--image_grid={text!r} must be three positive integers T,H,W (patches), e.g. 1,8,8")
    return grid


__all__ = ["DEFAULT_DS_CONFIG", "TrainConfigError", "build_parser", "resolve_args", "parse_grid"]
