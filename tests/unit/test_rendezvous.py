"""A rendezvous that cannot happen ends with an error naming MASTER_ADDR/MASTER_PORT, this host and
the timeout key: at once for a name that does not resolve, after the timeout for an address where no
rank 0 listens (torch's real TCP store, in this process: a failed init leaves no process group)."""
import datetime
import socket
import time

import pytest
import torch.distributed as dist

from ds_seqpar.launch.rendezvous import RendezvousError, join


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]       # nothing listens there once the socket closes


def test_unresolvable_master_addr_is_refused_at_once_without_trying():
    env = {"RANK": "1", "MASTER_ADDR": "rank0.invalid", "MASTER_PORT": "29500"}
    tried = []
    start = time.time()
    with pytest.raises(RendezvousError, match=r"rank 1 on host .*MASTER_ADDR='rank0.invalid'.*does not resolve"):
        join(lambda: tried.append(1), env, timeout_s=600)
    assert not tried and time.time() - start < 10


def test_unreachable_rendezvous_names_the_address_and_the_timeout_key():
    port = _closed_port()
    env = {"RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    init = lambda: dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1,  # noqa: E731
                                           world_size=2, timeout=datetime.timedelta(seconds=2))
    start = time.time()
    with pytest.raises(RendezvousError, match=rf"MASTER_PORT='{port}'.*sequence_parallel.timeout_s=2 s"):
        join(init, env, timeout_s=2)
    assert time.time() - start < 60 and not dist.is_initialized()


def test_a_failed_rendezvous_under_torchrun_restarts_with_the_shared_store_names_the_fix():
    """A restarted round that joins through torchrun's shared store reads the killed round's addresses:
    the error says how to start torchrun (the multinode tier restarts a job the way it says)."""
    def fails():
        raise RuntimeError("Gloo connectFullMesh failed with ... Connection refused")
    env = {"RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_MAX_RESTARTS": "1"}
    with pytest.raises(RendezvousError) as plain:
        join(fails, env, timeout_s=20)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in str(plain.value)
    with pytest.raises(RendezvousError, match=r"Connection refused.*torchrun --max-restarts start torchrun with "
                                              r"--rdzv-backend c10d and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        join(fails, dict(env, TORCHELASTIC_USE_AGENT_STORE="True"), timeout_s=20)
