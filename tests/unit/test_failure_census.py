"""The failure path's census (train/census.py) and the host map (launch/hosts.py), without a
world: a fake store stands in for the rendezvous store. Across real hosts: tests/multinode."""
import threading
import time

import pytest

from ds_seqpar.launch import hosts
from ds_seqpar.train import census as census_module

HOSTS = [{"host": "a", "addr": "10.0.0.1"}, {"host": "a", "addr": "10.0.0.1"},
         {"host": "b", "addr": "10.0.0.2"}, {"host": "b", "addr": "10.0.0.2"}]


class FakeStore:
    def __init__(self, keys=None, blocks=False):
        self.keys, self.blocks = dict(keys or {}), blocks

    def set(self, key, value):
        self.keys[key] = value.encode()

    def check(self, keys):
        if self.blocks:                 # a cut link: the answer never comes
            threading.Event().wait()
        return all(k in self.keys for k in keys)

    def get(self, key):
        return self.keys[key]


@pytest.fixture
def world(monkeypatch):
    def use(store, rank=0, size=4):
        dist = census_module.dist
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_rank", lambda: rank)
        monkeypatch.setattr(dist, "get_world_size", lambda: size)
        monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    return use


def test_census_names_the_ranks_that_never_report(world):
    world(FakeStore({"ds_seqpar/failed/1": b"RuntimeError: timed out"}))
    census = census_module.failure_census("RuntimeError: timed out", wait_s=0.5)
    assert census.silent == [2, 3] and sorted(census.said) == [0, 1] and not census.store_error


def test_census_is_bounded_when_the_store_never_answers(world):
    world(FakeStore(blocks=True), rank=2)
    start = time.monotonic()
    census = census_module.failure_census("RuntimeError: timed out", wait_s=0.5)
    assert time.monotonic() - start < 0.5 + 2.0 + 1.0
    assert census.store_error == "no answer within 2s" and census.silent == [0, 1, 2, 3]


def test_no_world_no_census():
    assert census_module.failure_census("x", wait_s=0) is None


def test_where_groups_ranks_by_host():
    assert hosts.where([2, 3], HOSTS) == "host b (10.0.0.2): rank(s) 2, 3"
    assert hosts.where([1, 2], HOSTS) == "host a (10.0.0.1): rank(s) 1; host b (10.0.0.2): rank(s) 2"
    assert hosts.where([5], HOSTS) == ""          # no map (or a smaller one): nothing to say
    assert hosts.ranks_at("10.0.0.1", HOSTS) == [0, 1] and hosts.ranks_at("b", HOSTS) == [2, 3]


def test_this_host_takes_the_address_on_the_route_to_the_master():
    assert hosts.this_host({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})["addr"] == "127.0.0.1"
    assert hosts.this_host({})["addr"] == ""


def test_sever_peer_links_cuts_peers_and_keeps_the_store():
    import socket
    from ds_seqpar.launch.links import sever_peer_links
    peer_srv, store_srv = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))
    mine = socket.create_connection(peer_srv.getsockname())
    peer, _ = peer_srv.accept()
    to_store = socket.create_connection(store_srv.getsockname())
    store, _ = store_srv.accept()
    try:
        assert sever_peer_links({"MASTER_PORT": str(store_srv.getsockname()[1])}) >= 2
        peer.settimeout(5)
        assert peer.recv(1) == b""                        # the peer sees the link closed at once
        to_store.sendall(b"x")
        store.settimeout(5)
        assert store.recv(1) == b"x"                      # the store's connection still works
    finally:
        for s in (mine, peer, to_store, store, peer_srv, store_srv):
            s.close()
