"""DeepSpeed checkpoints of the main job: saved every ``--save_interval`` steps with the step in
the client state, resumed from ``--save_dir`` (latest, or ``--resume_tag``). Batches are a pure
function of the step (data.py), so a resumed run continues the uninterrupted trajectory."""
from __future__ import annotations

from .args import TrainConfigError


def resume(engine, opts, say) -> int:
    """Load the checkpoint the options name; return the step to continue from (0: fresh run)."""
    if not (opts.resume or opts.resume_tag):
        return 0
    if not opts.save_dir:
        raise TrainConfigError("--resume needs --save_dir (where the checkpoints are)")
    path, client = engine.load_checkpoint(opts.save_dir, tag=opts.resume_tag)
    if path is None:
        raise TrainConfigError(f"no checkpoint to resume in --save_dir {opts.save_dir!r} "
                               f"(tag {opts.resume_tag or 'latest'!r})")
    say(f"resumed from {path} at step {client['step']}")
    return int(client["step"])


def maybe_save(engine, opts, step_done: int) -> None:
    """Save after ``step_done`` steps when the interval (or the last step) says so."""
    if opts.save_dir and opts.save_interval and (step_done % opts.save_interval == 0 or step_done == opts.steps):
        engine.save_checkpoint(opts.save_dir, tag=f"step{step_done}",
                               client_state={"step": step_done, "seq_len": opts.seq_len, "seed": opts.seed})


__all__ = ["maybe_save", "resume"]
