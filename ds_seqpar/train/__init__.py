"""The main job: ``python -m ds_seqpar.train`` (or ``ds-seqpar train``) trains a causal LM with any
sequence-parallel strategy and ZeRO.

    main.py        entry: command line, joining the world, config, model, then the Trainer
    trainer.py     the loop: load, step, save, log
    args.py        the command line and its checks
    hf_model.py    --model PATH: a local Hugging Face model behind the trainer's (ids, positions) -> logits call
    data.py        the embedded corpus, token files and the batch of each step
    checkpoint.py  DeepSpeed checkpoints and resume
    metrics.py     per-step measurements, their cross-rank reduction and the loggers
    runlog.py      run directory, run.json / metrics.jsonl, wandb
    faults.py      fault injection for the reliability tests
"""
from .main import main, run_training

__all__ = ["main", "run_training"]
