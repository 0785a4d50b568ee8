"""Hosts on one machine: each a Linux network namespace with its own interface (``mn0``), address
and /etc/hosts, joined through a bridge in a "switch" namespace (nothing is added to the machine's
own network). bin/ssh enters a host the way sshd would start a command there (own hostname, own
/dev/shm). Everything is named with PREFIX, so a crashed earlier run's leftovers are found and
removed before a new setup, and by teardown whatever a test did.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import subprocess
import time
from typing import List

PREFIX = "dsmn-"
SWITCH = PREFIX + "switch"
IFNAME = "mn0"                    # every host's interface: GLOO_SOCKET_IFNAME=mn0 on all of them
SUBNET = "10.77.0"
BIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str:
    """Why hosts cannot be built here ('' when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not on PATH"
    probe = f"{PREFIX}probe{os.getpid()}"         # each pytest-xdist worker probes at collection, at once
    made = _ip("netns", "add", probe, check=False)
    _ip("netns", "del", probe, check=False)
    if made.returncode:
        return f"'ip netns add' failed: {made.stderr.strip()}"
    return ""


def names() -> List[str]:
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    return [line.split()[0] for line in listed if line.startswith(PREFIX)]


def kill_inside(ns: str) -> None:
    """SIGKILL every process in a namespace (ranks, launchers' agents)."""
    for pid in _ip("netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def cleanup() -> None:
    """Remove every PREFIX namespace, its processes and /etc/netns files (also an earlier run's)."""
    for ns in names():
        kill_inside(ns)
    time.sleep(0.2 if names() else 0)
    for ns in names():
        _ip("netns", "del", ns, check=False)       # its veth ends go with it
    for path in glob.glob(f"/etc/netns/{PREFIX}*"):
        shutil.rmtree(path, ignore_errors=True)


class Hosts:
    """``n`` hosts named dsmn-a, dsmn-b, ... at SUBNET.1, .2, ..., all on one bridge."""

    def __init__(self, n: int):
        self.names = [f"{PREFIX}{chr(ord('a') + i)}" for i in range(n)]
        self.addrs = [f"{SUBNET}.{i + 1}" for i in range(n)]

    def up(self) -> "Hosts":
        cleanup()
        _ip("netns", "add", SWITCH)
        _ip("-n", SWITCH, "link", "add", "br0", "type", "bridge")
        _ip("-n", SWITCH, "link", "set", "br0", "up")
        etc_hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for h, a in zip(self.names, self.addrs))
        for i, (host, addr) in enumerate(zip(self.names, self.addrs)):
            _ip("netns", "add", host)
            # `ip netns exec` mounts /etc/netns/<ns>/hosts over /etc/hosts: the hosts resolve each other
            os.makedirs(f"/etc/netns/{host}", exist_ok=True)
            with open(f"/etc/netns/{host}/hosts", "w") as f:
                f.write(etc_hosts)
            _ip("link", "add", f"{PREFIX}h{i}", "netns", host, "type", "veth",
                "peer", "name", f"{PREFIX}s{i}", "netns", SWITCH)
            _ip("-n", host, "link", "set", f"{PREFIX}h{i}", "name", IFNAME)
            _ip("-n", host, "addr", "add", f"{addr}/24", "dev", IFNAME)
            _ip("-n", host, "link", "set", IFNAME, "up")
            _ip("-n", host, "link", "set", "lo", "up")
            _ip("-n", SWITCH, "link", "set", f"{PREFIX}s{i}", "master", "br0")
            _ip("-n", SWITCH, "link", "set", f"{PREFIX}s{i}", "up")
        return self

    def link(self, host: str, state: str) -> None:
        """Set a host's interface 'down' (its cable pulled) or 'up'."""
        _ip("-n", host, "link", "set", IFNAME, state)

    def impair(self, host: str, qdisc: str) -> None:
        """Shape the packets a host sends with a ``tc`` qdisc ("" clears it). This machine's kernel has
        ``tbf`` but neither ``netem`` nor tc's filter actions, so a lossy link is a token bucket whose
        short queue drops what a burst overflows (TCP retransmits it) and delays what it holds."""
        args = ["ip", "netns", "exec", host, "tc", "qdisc"]
        subprocess.run([*args, "del", "dev", IFNAME, "root"], capture_output=True, timeout=30)
        if qdisc:
            subprocess.run([*args, "add", "dev", IFNAME, "root", *qdisc.split()], check=True,
                           capture_output=True, timeout=30)

    def dropped(self, host: str) -> int:
        """Packets the host's qdisc dropped since it was set."""
        out = subprocess.run(["ip", "netns", "exec", host, "tc", "-s", "qdisc", "show", "dev", IFNAME],
                             capture_output=True, text=True, timeout=30).stdout
        return sum(int(n) for n in re.findall(r"dropped (\d+)", out))

    def env(self) -> dict:
        """The environment for a launcher reaching these hosts: bin/ssh first on PATH."""
        return dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}")
