"""One pool of 4 CPU gloo ranks for the whole session, a session per xdist worker (process start + imports
are slow on 2 cores).

Tests at 2 ranks use sequence_parallel.size=2 on this world, i.e. two independent sequence groups
of 2 ranks (dp=2): a sweep of several configs splits them between the groups, a single case runs on the
first group alone (tests/dist_checks.py: group_shares, first_group_runs), and the rest check theirs on both.
"""
import getpass
import os
import pathlib
import shutil
import tempfile

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

# What the session's ranks and launched jobs leave in the temporary directory (TRL's shared reference caches,
# wandb's media folders, torchrun's rendezvous folders, Open MPI's session folders) goes into one folder of this
# session, removed at its end: TMPDIR is read by every process started from here. This process keeps the
# machine's (gettempdir() pins it at its first call, here), so pytest's own tmp_path folders stay where a
# failed run's are looked for. Inductor's cache stays the machine's too (its default is under TMPDIR).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))
SESSION_TMP = tempfile.mkdtemp(prefix="ds_seqpar_session_")
os.environ["TMPDIR"] = SESSION_TMP


def pytest_unconfigure(config):
    shutil.rmtree(SESSION_TMP, ignore_errors=True)


# imported once by the rank pools' fork server instead of by every rank (seconds each on 2 cores): most pool
# tests build a transformers model, Llama the most; before any pool starts (the bench and tool tests start
# their own), so every pool in the session forks from a server that has them
from ds_seqpar.launch import rankpool  # noqa: E402

rankpool.preload("transformers.modeling_utils", "transformers.models.llama.modeling_llama")

WORLD = 4
COLLECTED = pytest.StashKey[set]()      # the test files this session collected (tests/unit/test_collection.py)


def pytest_itemcollected(item):
    # before any -k / -m deselection: what the command line collects, not what it runs
    item.config.stash.setdefault(COLLECTED, set()).add(item.nodeid.split("::")[0])


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # Under pytest-xdist's --dist loadgroup (setup.cfg's addopts: two workers) each worker that runs a test on
    # a rank pool starts its own pools, so the pools' tests come in two groups of about equal time, one a worker:
    # the multi-rank tier (tests/dist) and the rest (the end-to-end and tools tests that compare against the
    # pool, and the hosts tier, whose network namespaces and addresses are fixed names: one worker runs all of
    # it). The other tests (launches, unit tests) fill in beside them. Without xdist the marks are inert.
    tests = pathlib.Path(__file__).parent
    for item in items:
        folder = pathlib.Path(item.path).relative_to(tests).parts[0]
        if folder == "multinode":
            item.add_marker(pytest.mark.xdist_group("pools_and_hosts"))
        elif {"pool", "pool2"} & set(item.fixturenames):
            item.add_marker(pytest.mark.xdist_group("pools_dist" if folder == "dist" else "pools_and_hosts"))


@pytest.fixture(scope="session")
def pool():
    from ds_seqpar.launch.rankpool import RankPool
    p = RankPool(WORLD, timeout_s=180.0).start()
    yield p
    p.close()


@pytest.fixture(scope="session")
def pool2():
    """2 CPU gloo ranks, started on first use: plain data parallelism with as many processes as a size-2 run on
    the 4-rank pool has replicas (TRL's GRPO: each process seeds and samples by its own index)."""
    from ds_seqpar.launch.rankpool import RankPool
    p = RankPool(2, timeout_s=180.0).start()
    yield p
    p.close()
