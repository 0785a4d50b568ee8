"""DeepSpeed checkpoints of the main job: saved every ``--save_interval`` steps with the step in
the client state, resumed from ``--save_dir`` (latest, or ``--resume_tag``). Batches are a pure
function of the step (data.py), so a resumed run continues the uninterrupted trajectory.

``--resume_universal`` resumes at another shape (data-parallel or sequence-parallel size,
strategy): rank 0 converts the checkpoint once with DeepSpeed's ds_to_universal
(``--inject_missing_state``: the model records no universal-checkpoint info of its own) into
``<tag>_universal`` beside it, and every rank loads that with "checkpoint": {"load_universal":
true}. Same global batch (replicas x micro batch x accumulation) -> the same trajectory.
deepspeed 0.19 loads it only at the ZeRO stage family it was saved with (1/2, or 3): another one
is refused before loading.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import io
import os
import shutil

from .. import comm
from .args import TrainConfigError


def resume(engine, opts, say) -> int:
    """Load the checkpoint the options name; return the step to continue from (0: fresh run)."""
    if not (opts.resume or opts.resume_tag or opts.resume_universal):
        return 0
    if not opts.save_dir:
        raise TrainConfigError("--resume, --resume_tag and --resume_universal need --save_dir (where the "
                               "checkpoints are)")
    tag = opts.resume_tag
    if tag is None and not opts.resume_universal and restarted_by_torchrun() \
            and not os.path.exists(os.path.join(opts.save_dir, "latest")):
        # torchrun --max-restarts reruns the same command: its first start has nothing to resume yet
        say(f"--resume: no checkpoint in --save_dir {opts.save_dir!r} yet; starting at step 0 (torchrun "
            f"--max-restarts={os.environ['TORCHELASTIC_MAX_RESTARTS']} resumes from the latest one on a restart)")
        return 0
    if opts.resume_universal:
        tag = universal_tag(opts.save_dir, tag)
        _check_stage(os.path.join(opts.save_dir, tag), engine.zero_optimization_stage())
    path, client = engine.load_checkpoint(opts.save_dir, tag=tag)
    if path is None:
        raise TrainConfigError(f"no checkpoint to resume in --save_dir {opts.save_dir!r} "
                               f"(tag {tag or 'latest'!r})")
    say(f"resumed from {path} at step {client['step']}")
    return int(client["step"])


def restarted_by_torchrun() -> bool:
    """Launched by torchrun with --max-restarts > 0 (it sets TORCHELASTIC_MAX_RESTARTS for its ranks)."""
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0


def universal_tag(save_dir: str, tag) -> str:
    """``<tag>_universal`` in save_dir, converted by rank 0 if it is not there yet; every rank
    gets the same tag, or the same error."""
    tag = tag or _latest(save_dir)
    out = f"{tag}_universal"
    error = None
    if comm.global_rank() == 0 and not os.path.isdir(os.path.join(save_dir, out)):
        try:
            to_universal(os.path.join(save_dir, tag), os.path.join(save_dir, out))
        except Exception as err:  # noqa: BLE001 - every rank must stop with rank 0's reason
            error = f"{type(err).__name__}: {err}"
    error = comm.gather_object(error)[0]            # also the barrier: no rank loads a half-written tag
    if error:
        raise TrainConfigError(f"--resume_universal: converting {os.path.join(save_dir, tag)} to a universal "
                               f"checkpoint failed: {error}")
    return out


def to_universal(src: str, dst: str) -> None:
    """DeepSpeed's ds_to_universal in this process (no worker pool: this rank may be a daemon
    process), written to a temporary folder renamed at the end, so a tag folder is whole."""
    from deepspeed.checkpoint import ds_to_universal
    if not os.path.isdir(src):
        raise FileNotFoundError(f"no checkpoint folder {src}")
    tmp = dst + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    args = argparse.Namespace(input_folder=src, output_folder=tmp, num_extract_workers=1, num_merge_workers=1,
                              keep_temp_folder=False, strict=True, inject_missing_state=True)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        ds_to_universal.main(args)
    os.replace(tmp, dst)


def _check_stage(folder: str, stage: int) -> None:
    """ZeRO-3 checkpoints name their model-state files per partition; DeepSpeed looks for the
    kind the current stage writes and fails with a bare assertion on the other."""
    saved3 = bool(glob.glob(os.path.join(folder, "zero_pp_rank_*_model_states.pt")))
    if saved3 != (stage == 3):
        saved = "3" if saved3 else "1 or 2"
        raise TrainConfigError(f"--resume_universal: {folder} was saved with ZeRO stage {saved}; deepspeed loads "
                               f"it only at that stage, not at zero_optimization.stage={stage}: resume at stage "
                               f"{saved} (other sizes and strategies are fine)")


def _latest(save_dir: str) -> str:
    path = os.path.join(save_dir, "latest")
    if not os.path.exists(path):
        raise TrainConfigError(f"--resume_universal: no 'latest' file in --save_dir {save_dir!r}; pass "
                               f"--resume_tag")
    with open(path) as f:
        return f.read().strip()


def maybe_save(engine, opts, step_done: int) -> None:
    """Save after ``step_done`` steps when the interval (or the last step) says so.

    ``latest`` names a tag only once every rank has written its files. DeepSpeed's own ``latest`` is written by
    rank 0 before the save's closing barrier, so a rank killed while saving (a lost host) left it naming a tag
    without that rank's optimizer partition, and the restart's --resume failed on the missing file. Here the
    save's barrier comes first, then rank 0 replaces ``latest`` in one rename."""
    if opts.save_dir and opts.save_interval and (step_done % opts.save_interval == 0 or step_done == opts.steps):
        tag = f"step{step_done}"
        engine.save_checkpoint(opts.save_dir, tag=tag, save_latest=False,
                               client_state={"step": step_done, "seq_len": opts.seq_len, "seed": opts.seed})
        if comm.global_rank() == 0:
            write_latest(opts.save_dir, tag)


def write_latest(save_dir: str, tag: str) -> None:
    """``save_dir/latest`` = ``tag``, replaced atomically (a reader sees the old tag or the new one)."""
    tmp = os.path.join(save_dir, "latest.partial")
    with open(tmp, "w") as f:
        f.write(tag)
    os.replace(tmp, os.path.join(save_dir, "latest"))


__all__ = ["maybe_save", "resume", "to_universal", "universal_tag"]
