"""The multi-node tier: 2 hosts x 2 ranks as network namespaces (netns.py), reached through an ssh
that enters them (bin/ssh). Runs as root where `ip netns` works; skips with the reason elsewhere."""
import shutil

import pytest

from . import netns

UNAVAILABLE = netns.unavailable()


def needs(tool: str):
    return pytest.mark.skipif(shutil.which(tool) is None, reason=f"{tool} is not on PATH")


def hosts_up(n: int):
    """``n`` hosts for one module (setup takes a second; the jobs take the time); removed even if a
    test fails, and an earlier crashed run's leftovers are removed first (Hosts.up)."""
    if UNAVAILABLE:
        pytest.skip(f"no network namespaces here: {UNAVAILABLE}")
    try:
        yield netns.Hosts(n).up()
    finally:
        netns.cleanup()


@pytest.fixture(scope="module")
def hosts():
    yield from hosts_up(2)


@pytest.fixture
def fresh(hosts):
    """The hosts as a test found them afterwards too: every link up, no process left inside."""
    yield hosts
    for name in hosts.names:
        netns.kill_inside(name)
        hosts.link(name, "up")
        hosts.impair(name, "")
