"""The main job under every launcher (subprocesses: slow, so tiny and few; deselect with ``-m "not
launcher"``): deepspeed, mpirun, torchrun and no launcher (``--nprocs``) each train to the end at 4 ranks
(under deepspeed a Hugging Face hybrid from a shipped config, wandb on); and under each, at 2 ranks, one
rank failing at step 0 ends the whole job non-zero within seconds, its error said once with its rank.
Plus: a bad config is said once per job, by rank 0, with or without a launcher. (A killed and a hung rank,
at 2 ranks too: test_failures.py.)"""
import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from ds_seqpar.launch.env import free_port

pytestmark = pytest.mark.launcher

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
NPROC = 4
SHORT = ["--steps", "2", "--seq_len", "64", "--corpus_bytes", "262144", "--no_progress"]
TINY = [*SHORT, "--dim", "32", "--n_layers", "2"]      # the own LM
FAST_EXIT_S = 30          # from the fault to the end of the job
FAULT_TIMEOUT_S = 60      # the collective timeout of the failure runs: waiting for it would fail FAST_EXIT_S

# the failure runs: the failing rank and a peer blocked in a collective with it are what a failure case needs,
# and 2 ranks start in half the time of 4 on 2 cores (their imports are most of a launch)
FAULT_NPROC = 2

# how a user starts n ranks with each launcher
LAUNCH = {
    "deepspeed": lambda n=NPROC: ["deepspeed", "--num_gpus", str(n), "--master_port", str(free_port()),
                                  "--module", "ds_seqpar.train"],
    # on 2 cores, -np 4 maps rank 2 to local rank 1: the local rank must be Open MPI's
    "mpirun": lambda n=NPROC: ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(n), sys.executable,
                               "-m", "ds_seqpar.train", "--master_port", str(free_port())],
    "torchrun": lambda n=NPROC: ["torchrun", "--standalone", "--nproc_per_node", str(n), "-m", "ds_seqpar.train"],
    "nprocs": lambda n=NPROC: [sys.executable, "-m", "ds_seqpar.train", "--nprocs", str(n)],
}
# the last rank fails at step 0 (its peer is then in a collective with it); under mpirun by
# KeyboardInterrupt, the case that used to hang in MPI_Finalize
FAULT = {"deepspeed": ("raise", "InjectedFault"), "mpirun": ("interrupt", "KeyboardInterrupt"),
         "torchrun": ("raise", "InjectedFault"), "nprocs": ("raise", "InjectedFault")}


def needs(launcher):
    exe = LAUNCH[launcher]()[0]
    return pytest.mark.skipif(shutil.which(exe) is None, reason=f"{exe} not on PATH")


MATRIX = [pytest.param(name, marks=needs(name)) for name in LAUNCH]


def run(cmd, timeout=300, **env):
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", PYTHONUNBUFFERED="1", **env)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def config(tmp_path, **sequence_parallel):
    """configs/ulysses_zero2.json (size 2: 2 data x 2 sequence ranks) with overrides."""
    with open(os.path.join(ROOT, "configs", "ulysses_zero2.json")) as f:
        ds = json.load(f)
    ds["sequence_parallel"].update(sequence_parallel)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    return str(path)


def run_with_fault(cmd, fault, timeout=240):
    """Run with DS_SEQPAR_FAULT; return (exit code, output, seconds from the fault to the end)."""
    code, out = run(cmd, timeout=timeout, DS_SEQPAR_FAULT=fault)
    ended = time.time()
    injected = re.search(r"DS_SEQPAR_FAULT: rank \d+ \w+ at step \d+, t=([\d.]+)", out)
    assert injected, f"the fault {fault} was never injected:\n{out[-3000:]}"
    return code, out, ended - float(injected.group(1))


def metrics_of(run_dir, steps):
    (name,) = os.listdir(run_dir)
    with open(os.path.join(run_dir, name, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), rows
    assert all(math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in rows), rows
    # each step's memory (memory/usage.py): what a rank held before it, and its peak above that
    assert all(r["peak_mem_mb"] >= r["static_mem_mb"] > 0 and r["step_mem_mb"] > 0 for r in rows), rows
    with open(os.path.join(run_dir, name, "run.json")) as f:
        return rows, json.load(f)


# what each launcher trains: the own LM under Ulysses, and under the deepspeed launcher a Hugging Face model from
# a shipped config (random init: the Mamba2 hybrid, its SSD state maps and conv halos, docs/hybrids.md) under
# zigzag with wandb on (offline). A dense model's --model run is the README's command, run on the pool's ranks
# (tests/e2e/test_hf_train.py).
JOB = {"deepspeed": ["--model", "configs/models/bamba_small.json", "--deepspeed_config", "configs/zigzag_zero2.json",
                     *SHORT]}
OWN_LM_JOB = ["--deepspeed_config", "configs/ulysses_zero2.json", *TINY, "--no_wandb"]


@pytest.mark.parametrize("launcher", MATRIX)
def test_launcher_trains_to_the_end(launcher, tmp_path):
    runs = tmp_path / "runs"
    hf = launcher == "deepspeed"
    cmd = [*LAUNCH[launcher](), *JOB.get(launcher, OWN_LM_JOB), "--run_dir", str(runs)]
    try:
        code, out = run(cmd)
    finally:
        # DeepSpeed's CPU shared-memory all-reduce would build a C++ op and leave a 66 MB /dev/shm buffer per
        # rank; the main job skips it (ds_seqpar/deepspeed_shm.py): a leftover of a broken skip is removed here
        port = cmd[cmd.index("--master_port") + 1] if hf else None
        leftovers = glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*") if hf else []
        for leftover in leftovers:
            os.remove(leftover)
    assert code == 0, out[-4000:]
    _, run_config = metrics_of(runs, 2)
    assert (run_config["world_size"], run_config["sp_size"], run_config["dp_size"]) == (NPROC, 2, 2), run_config
    if hf:
        assert not leftovers, f"the job left DeepSpeed's shared-memory buffers behind: {leftovers}"
        assert "deepspeed_shm_comm" not in out, "DeepSpeed built or loaded its shm op:\n" + out[-4000:]
        assert run_config["model"]["architecture"] == "BambaConfig" and run_config["strategy"] == "zigzag", run_config
        assert "wandb run ->" in out, out[-4000:]
        assert list((runs / os.listdir(runs)[0] / "wandb").glob("offline-run-*")), f"no offline wandb run in {runs}"


@pytest.mark.parametrize("launcher", MATRIX)
def test_one_failing_rank_ends_the_job_within_seconds(launcher, tmp_path):
    mode, error = FAULT[launcher]
    failing = FAULT_NPROC - 1
    cmd = [*LAUNCH[launcher](FAULT_NPROC), "--deepspeed_config", config(tmp_path, timeout_s=FAULT_TIMEOUT_S), *TINY,
           "--no_wandb", "--run_dir", str(tmp_path / "runs")]
    code, out, secs = run_with_fault(cmd, f"{failing}:0:{mode}")
    print(f"{launcher}: rank {failing} {mode} -> job ended {secs:.1f}s later, exit code {code}")   # shown with -s
    assert code != 0, out[-4000:]
    assert secs < FAST_EXIT_S, f"{launcher}: the job ended {secs:.1f}s after rank {failing} failed\n{out[-4000:]}"
    said = [line for line in out.splitlines() if line.startswith(f"ds_seqpar.train: rank {failing} failed:")]
    assert len(said) == 1 and said[0].startswith(f"ds_seqpar.train: rank {failing} failed: {error}"), out[-4000:]


def test_no_launcher_bad_config_exits_with_one_message(tmp_path):
    # found by each rank (the heads need the model), said by rank 0 alone
    code, out = run([*LAUNCH["nprocs"](2), "--deepspeed_config", "configs/ulysses_zero2.json", *TINY,
                     "--n_heads", "3", "--dim", "48", "--no_wandb", "--run_dir", str(tmp_path / "runs")])
    assert code == 2, out[-4000:]
    errors = [line for line in out.splitlines() if line.startswith("ds_seqpar.train: error:")]
    assert len(errors) == 1, out[-4000:]
    assert "3 q heads are not divisible by 2" in errors[0], errors[0]
    assert "Traceback" not in out, out[-4000:]


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_launcher_bad_config_is_said_once_before_torch_loads(tmp_path):
    # every rank finds it from argv and the config alone, without loading torch; rank 0 says it (torchrun
    # then reports its children's exit codes in its own words)
    started = time.monotonic()
    code, out = run([*LAUNCH["torchrun"](), "--strategy", "stripe", *TINY, "--no_wandb",
                     "--run_dir", str(tmp_path / "runs")])
    assert code != 0, out[-4000:]
    errors = [line for line in out.splitlines() if "ds_seqpar.train: error:" in line]
    assert errors == ["ds_seqpar.train: error: sequence_parallel.strategy='stripe' is not valid (did you mean "
                      "'striped'?); choose one of: ulysses, ring, zigzag, striped, lasp"], out[-4000:]
    print(f"torchrun x{NPROC}: bad strategy said after {time.monotonic() - started:.1f}s")   # shown with -s
