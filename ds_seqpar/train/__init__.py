"""The main job: ``python -m ds_seqpar.train`` (or ``ds-seqpar train``) trains a causal LM with any
sequence-parallel strategy and ZeRO.

    preflight.py   the front door: the options and the config checked before torch loads, said once
    main.py        the job: joining the world, config, model, then the Trainer; its failure path
    trainer.py     the loop: load, step, save, log
    args.py        the command line and its checks
    hf_model.py    --model PATH: a local Hugging Face model behind the trainer's (ids, positions) -> logits call
    data.py        the embedded corpus, token files and the batch of each step
    checkpoint.py  DeepSpeed checkpoints and resume
    metrics.py     per-step measurements, their cross-rank reduction and the loggers
    runlog.py      run directory, run.json / metrics.jsonl, wandb
    faults.py      fault injection for the reliability tests

run_training loads on first use (PEP 562), so that ``python -m ds_seqpar.train`` checks its command line
before torch loads; the command itself is ``ds_seqpar.train.main.main(argv)`` (after preflight.main's checks).
"""

__all__ = ["run_training"]


def __getattr__(name: str):
    if name == "run_training":
        from .main import run_training
        return run_training
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
