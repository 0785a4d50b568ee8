"""The main job on the namespace hosts, started as users start it on real ones: torchrun on every
host (through ssh, one per node), or one `deepspeed --hostfile` whose pdsh/openmpi reaches them
through ssh. Commands are built here once; docs/launchers.md shows the same."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

from .netns import IFNAME, Hosts

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
RANKS_PER_HOST = 2
TINY = ["--seq_len", "64", "--dim", "32", "--n_layers", "2", "--corpus_bytes", "131072", "--no_progress",
        "--no_wandb"]
# what a rank needs on a remote host besides the command: the interface gloo binds to (else it
# takes the address the hostname resolves to), one thread per rank on a shared CPU, this
# checkout when the package is not installed, and the session's temporary folder (tests/conftest.py:
# the namespace hosts share this machine's files, and ssh starts a login environment without it)
REMOTE_ENV = {"GLOO_SOCKET_IFNAME": IFNAME, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
              **{k: os.environ[k] for k in ("PYTHONPATH", "TMPDIR") if os.environ.get(k)}}


def ds_config(tmp_path, **sequence_parallel) -> str:
    """configs/ulysses_zero2.json with sequence_parallel overrides, written to tmp_path."""
    with open(os.path.join(ROOT, "configs", "ulysses_zero2.json")) as f:
        ds = json.load(f)
    ds["sequence_parallel"].update(sequence_parallel)
    path = os.path.join(str(tmp_path), f"ds-{len(os.listdir(str(tmp_path)))}.json")
    with open(path, "w") as f:
        json.dump(ds, f)
    return path


def torchrun_on(hosts: Hosts, node: int, port: int, train_args: Sequence[str], nnodes: Optional[int] = None,
                nproc: int = RANKS_PER_HOST, max_restarts: int = 0) -> List[str]:
    """ssh HOST torchrun ...: node ``node`` of ``nnodes`` (all hosts), static rendezvous at host 0; with
    ``max_restarts``, the c10d rendezvous hosted by host 0's agent (static ranks never re-form a world),
    its store not shared with the ranks (a restarted round would read the killed round's addresses)."""
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in REMOTE_ENV.items())
    if max_restarts:
        exports += " TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
        rdzv = (f"--rdzv-backend c10d --rdzv-id ds_seqpar --max-restarts {max_restarts} "
                f"--rdzv-conf is_host={int(node == 0)}")
    else:
        rdzv = f"--node-rank {node}"
    torchrun = (f"torchrun --nnodes {nnodes or len(hosts.names)} {rdzv} "
                f"--nproc-per-node {nproc} --rdzv-endpoint {hosts.addrs[0]}:{port} "
                f"-m ds_seqpar.train {' '.join(map(shlex.quote, train_args))}")
    return ["ssh", hosts.names[node], f"cd {shlex.quote(ROOT)} && env {exports} {torchrun}"]


def slurm_tasks(hosts: Hosts, port: int, train_args: Sequence[str]) -> List[List[str]]:
    """Each rank started on its host with the environment srun gives a task (no launcher process
    between: the job step's tasks are the ranks), RANKS_PER_HOST per host, through ssh."""
    world, cmds = RANKS_PER_HOST * len(hosts.names), []
    for node, host in enumerate(hosts.names):
        for local in range(RANKS_PER_HOST):
            slurm = {"SLURM_PROCID": node * RANKS_PER_HOST + local, "SLURM_LOCALID": local, "SLURM_NODEID": node,
                     "SLURM_STEP_NUM_TASKS": world, "SLURM_STEP_NUM_NODES": len(hosts.names),
                     "SLURM_STEP_TASKS_PER_NODE": f"{RANKS_PER_HOST}(x{len(hosts.names)})",
                     "SLURM_STEP_NODELIST": ",".join(hosts.names)}
            exports = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in {**REMOTE_ENV, **slurm}.items())
            run = f"{sys.executable} -m ds_seqpar.train --master_port {port} {' '.join(map(shlex.quote, train_args))}"
            cmds.append(["ssh", host, f"cd {shlex.quote(ROOT)} && env {exports} {run}"])
    return cmds


def mpirun_hostfile(hosts: Hosts, tmp_path, train_args: Sequence[str], slots: int = 1,
                    extra_hosts: Sequence[str] = ()) -> List[str]:
    """mpirun --hostfile, started on host 0 (the head node: its daemons on the other hosts call back to
    it), reaching the others through ssh; its out-of-band channel and gloo on the hosts' interface."""
    hostfile = os.path.join(str(tmp_path), "mpi_hostfile")
    with open(hostfile, "w") as f:
        f.write("".join(f"{h} slots={slots}\n" for h in [*hosts.names, *extra_hosts]))
    exports = " ".join(f"-x {k}={shlex.quote(v)}" for k, v in REMOTE_ENV.items())
    mpirun = (f"mpirun --allow-run-as-root --hostfile {hostfile} -np {len(hosts.names) * slots} "
              f"--mca plm_rsh_agent ssh --prtemca oob_tcp_if_include {IFNAME} {exports} "
              f"{sys.executable} -m ds_seqpar.train {' '.join(map(shlex.quote, train_args))}")
    return ["ssh", hosts.names[0], f"cd {shlex.quote(ROOT)} && {mpirun}"]


def deepspeed_hostfile(hosts: Hosts, tmp_path, launcher: str, port: int, train_args: Sequence[str]) -> List[str]:
    """deepspeed --hostfile (``launcher`` pdsh or openmpi); the environment the ranks need goes in
    .deepspeed_env (DS_ENV_FILE), which DeepSpeed exports on every host. pdsh runs from this machine;
    mpirun's daemons call back to it, so the openmpi launcher runs on host 0 (the head node), told the
    hosts' interface (DeepSpeed's own default for MPI's transport is eth0) and to reach them by ssh."""
    hostfile = os.path.join(str(tmp_path), "hostfile")
    with open(hostfile, "w") as f:
        f.write("".join(f"{h} slots={RANKS_PER_HOST}\n" for h in hosts.names))
    env_file = os.path.join(str(tmp_path), ".deepspeed_env")
    with open(env_file, "w") as f:
        f.write("".join(f"{k}={v}\n" for k, v in REMOTE_ENV.items()))
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", hostfile, "--launcher", launcher,
           "--master_addr", hosts.addrs[0], "--master_port", str(port), "--module", "ds_seqpar.train", *train_args]
    if launcher != "openmpi":
        return cmd
    mpi = (f"--allow-run-as-root --mca btl_tcp_if_include {IFNAME} --mca plm_rsh_agent ssh "
           f"--prtemca oob_tcp_if_include {IFNAME}")
    cmd[cmd.index("--module"):cmd.index("--module")] = ["--launcher_args", mpi]
    return ["ssh", hosts.names[0], f"cd {shlex.quote(ROOT)} && env DS_ENV_FILE={shlex.quote(env_file)} "
                                   f"{' '.join(map(shlex.quote, cmd))}"]


class Job:
    """Launcher processes started together (one per host, or one for all), each in its own session
    so that all it started there can be stopped. Their output is read by threads: a rank left
    running on a cut-off host keeps the pipe open, and the test must not wait for that."""

    def __init__(self, cmds: Sequence[List[str]], env: Dict[str, str], cwd: str = ROOT):
        self.procs = [subprocess.Popen(c, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True, start_new_session=True) for c in cmds]
        self._lines: List[List[str]] = [[] for _ in self.procs]
        for p, lines in zip(self.procs, self._lines):
            threading.Thread(target=lambda p=p, lines=lines: lines.extend(p.stdout), daemon=True).start()

    def wait(self, timeout: float) -> List[Optional[int]]:
        """Exit codes (None: still running at the timeout, then stopped)."""
        deadline, codes = time.time() + timeout, []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(0.1, deadline - time.time())))
            except subprocess.TimeoutExpired:
                self.stop(p)
                codes.append(None)
        time.sleep(0.5)          # the readers take the last lines
        return codes

    @staticmethod
    def stop(p: subprocess.Popen) -> None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                self.stop(p)

    @property
    def output(self) -> str:
        return "\n".join("".join(lines) for lines in self._lines)


def losses(run_dir: str) -> List[float]:
    """Per-step losses from the run's metrics.jsonl (rank 0 writes it)."""
    (name,) = os.listdir(run_dir)
    return [r["loss"] for r in records(os.path.join(run_dir, name))]


def train_argv(argv):
    """On each rank of the session's pool: the main job with these command-line options."""
    from ds_seqpar.train import run_training
    from ds_seqpar.train.args import build_parser
    return run_training(vars(build_parser().parse_args(argv)))


def train_on_pool(pool, cfg: Sequence[str], run_dir: str) -> str:
    """The job of ``cfg`` on one host's 4 ranks (the session's pool); returns its run directory."""
    pool.run(train_argv, [*cfg, "--run_dir", run_dir])
    return run_dir


def records(run: str) -> List[dict]:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def run_info(run_dir: str) -> dict:
    (name,) = os.listdir(run_dir)
    return read_json(os.path.join(run_dir, name, "run.json"))


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def in_netns(pid: int, name: str) -> bool:
    """Whether process ``pid`` runs in network namespace ``name`` (ip netns identifies them by inode)."""
    return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(f"/run/netns/{name}").st_ino


def rank_pids(run_dir: str) -> Dict[int, int]:
    """{global rank: pid} of the rank processes of the job writing to ``run_dir`` (on any host:
    namespaces share the process table), not of the launchers around them."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
            if (len(argv) > 3 and os.path.basename(argv[0]).startswith("python") and argv[1] in ("-u", "-m")
                    and "ds_seqpar.train" in argv[1:4] and run_dir in argv):
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(kv.split("=", 1) for kv in f.read().decode(errors="replace").split("\0") if "=" in kv)
                found[int(env["RANK"] if "RANK" in env else env["SLURM_PROCID"])] = int(pid)   # srun sets no RANK
        except (OSError, KeyError, ValueError):
            continue
    return found


def steps_logged(run_dir: str) -> int:
    try:
        (name,) = os.listdir(run_dir)
        with open(os.path.join(run_dir, name, "metrics.jsonl")) as f:
            return sum(1 for _ in f)
    except (OSError, ValueError):
        return 0


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout:.0f}s")
        time.sleep(0.2)


def watch_ends(pids: Dict[int, int], timeout: float, since: Optional[float] = None) -> Dict[int, Optional[float]]:
    """Seconds from ``since`` (a time.time(); default now) until each rank process is gone (None: still
    there ``timeout`` s after it). A process already gone counts as ending now: an upper bound."""
    start, ends = time.time() if since is None else since, {r: None for r in pids}
    while time.time() - start < timeout and any(v is None for v in ends.values()):
        for r, pid in pids.items():
            if ends[r] is None and not os.path.exists(f"/proc/{pid}"):
                ends[r] = time.time() - start
        time.sleep(0.1)
    return ends
