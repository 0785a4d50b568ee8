"""The one LASP state exchange without processes: the chain both the own LM and the hybrids follow,
the transitions' apply / transpose / grad against autograd, and how hf/ reaches it (through
sp.linear_exchange, with no import circle)."""
import ast
import os

import pytest
import torch

import ds_seqpar
from ds_seqpar.sharding.documents import Documents
from ds_seqpar.sharding.layouts import make_layout
from ds_seqpar.strategies.closed_form import Shapes, closed_form_by_kind, linear_state_bytes, state_exchange_bytes
from ds_seqpar.strategies.lasp_chain import LaspChain, StateChain, cut_at_documents, fragments
from ds_seqpar.errors import ConfigError
from ds_seqpar.strategies.lasp_comm import EXCHANGES, exchange_for
from ds_seqpar.strategies.lasp_comm.common import FixedDecay, Transition
from ds_seqpar.strategies.lasp_comm.allscan import LINK_BYTES, MAX_SCAN_BLOCKS, scan_blocks

from .test_layers import imports_of, modules

ROOT = os.path.dirname(ds_seqpar.__file__)


def test_the_own_lms_chain_is_the_chain_of_its_contiguous_fragments():
    docs = [0, 3, 170, 240, 320]
    chain = LaspChain(4, 80, Documents(docs, 320))
    general = StateChain(cut_at_documents(fragments(make_layout("contiguous", 4), 320), docs), frozenset(docs[1:-1]))
    assert chain.frags == general.frags and chain.fed == general.fed and chain.feeds == general.feeds
    assert [len(s) for s in general.slots] == [1, 1, 0, 0] and general.width == 1
    assert general.chain_of((2, 0)) == [(1, 0), (0, 1)]


def test_slots_are_the_fragments_whose_state_another_reads():
    # zigzag P=2: rank 0's second run is the sequence's last, nobody reads its state: one slot per rank
    assert StateChain(fragments(make_layout("zigzag", 2), 16)).width == 1
    assert StateChain(fragments(make_layout("zigzag", 4), 32)).width == 2
    at_boundaries = [0, 8, 16, 24, 32]
    cut = cut_at_documents(fragments(make_layout("contiguous", 4), 32), at_boundaries)
    assert StateChain(cut, frozenset(at_boundaries[1:-1])).width == 0


def test_one_closed_form_for_the_own_lm_and_the_hybrids():
    """The own LM's LASP is the fixed transition on the contiguous chain: linear_state_bytes with one row,
    heads, dk, dv in fp32 gives closed_form_by_kind('lasp') rank by rank, for both exchanges."""
    frags = fragments(make_layout("contiguous", 4), 256)
    for comm in ("allgather", "ring", "allscan"):
        for r in range(4):
            want = closed_form_by_kind("lasp", 4, Shapes(1, 256, 8, 8, 16, 4, v_head_dim=12), r, lasp_comm=comm)
            assert linear_state_bytes(frags, r, 1, 8, 16, 12, comm, "fixed") == want, (comm, r)
    chain = StateChain(frags)
    # a travelling transition adds its A to every slot, both ways; the ring never sends A
    assert state_exchange_bytes(chain, 1, 100, 7, "allgather") == {"lasp_state": 3 * 107, "lasp_dstate": 3 * 107}
    assert state_exchange_bytes(chain, 1, 100, 7, "ring") == {"lasp_state": 100, "lasp_dstate": 100}
    # All-Scan: the ring's bytes in blocks, the same at every P (no A travels either); the allgather grows
    for p in (3, 4, 8):                        # rank 1: a middle rank, fed and feeding
        mid = StateChain(fragments(make_layout("contiguous", p), 64 * p))
        assert state_exchange_bytes(mid, 1, 100, 7, "allscan") == {"lasp_state": 100, "lasp_dstate": 100}
        assert state_exchange_bytes(mid, 1, 100, 7, "allgather")["lasp_state"] == (p - 1) * 107


def test_allscan_blocks_pipeline_only_past_one_hop_and_past_a_latencys_bytes():
    mb = 1 << 20
    assert [scan_blocks(p, 128, mb) for p in (1, 2, 3, 4, 8, 16)] == [1, 1, 2, 3, 5, 7]   # sqrt((P-2) S / LINK_BYTES)
    assert scan_blocks(16, 128, 1 << 30) == MAX_SCAN_BLOCKS and scan_blocks(16, 3, 1 << 30) == 3   # <= columns
    assert scan_blocks(4, 128, LINK_BYTES // 8) == 1          # a small state goes whole: a block would only add latency
    # the pick is the least of the priced time (P - 2 + K)(alpha + S / (K beta)) when alpha beta = LINK_BYTES
    for p, s in ((4, mb), (8, 4 * mb), (16, 16 * mb)):
        price = {k: (p - 2 + k) * (LINK_BYTES + s / k) for k in range(1, MAX_SCAN_BLOCKS + 1)}
        best = min(price, key=price.get)
        assert abs(scan_blocks(p, 128, s) - best) <= 1 and price[scan_blocks(p, 128, s)] <= 1.02 * price[best]


def test_an_unknown_lasp_comm_is_refused_by_name_where_the_exchanges_are_set_up():
    """The config refuses it first; a caller that builds the strategy or the linear exchange itself is
    refused there too, before any transfer (no process group is touched: ctx has none)."""
    from types import SimpleNamespace
    from ds_seqpar.strategies.lasp import LaspAttention
    from ds_seqpar.strategies.linear_exchange import LinearExchange
    ctx = SimpleNamespace(lasp_comm="p2p", layout=make_layout("contiguous", 2), sp_size=2, sp_rank=0, sp_group=None,
                          stats=None)
    for build in (lambda: exchange_for("p2p"), lambda: LaspAttention(ctx), lambda: LinearExchange("lasp", "p2p", ctx)):
        with pytest.raises(ConfigError, match=r"sequence_parallel.lasp_comm='p2p' is not valid; choose one of: "
                                              r"allgather, ring, allscan"):
            build()
    assert LinearExchange("ulysses", "p2p", ctx).heads_parallel          # ulysses exchanges no state: not read
    assert [exchange_for(c) for c in ("allgather", "ring", "allscan")] == list(EXCHANGES.values())


@pytest.mark.parametrize("shape", [(2, 3, 4, 4), (2, 3, 1, 1), (2, 3, 4, 1)])
def test_transition_transpose_and_grad_are_autograds(shape):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
    s = torch.randn(2, 3, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    d = torch.randn(2, 3, 4, 5, generator=g, dtype=torch.float64)
    da, ds = torch.autograd.grad(Transition(a).apply(s), (a, s), d)
    assert torch.allclose(Transition(a.detach()).transpose(d), ds)
    assert torch.allclose(Transition(a.detach()).grad(d, s.detach()), da)


def test_the_fixed_decay_is_lambda_to_the_length():
    decay = torch.tensor([0.5, 0.9])
    a = FixedDecay(decay, torch.float64).of_length(3).a
    assert a.shape == (2, 1, 1) and torch.allclose(a.flatten(), decay.double() ** 3)
    s = torch.randn(2, 4, 4)
    assert torch.equal(FixedDecay(None, torch.float32).of_length(3).apply(s), s)


def test_hf_linear_reads_no_config_and_no_layout():
    """The linear layers get everything about ranks from sp.linear_exchange (resolved once by sp)."""
    folder = os.path.join(ROOT, "hf", "linear")
    reads = []
    for f in sorted(os.listdir(folder)):
        if f.endswith(".py"):
            tree = ast.parse(open(os.path.join(folder, f)).read())
            reads += [f"{f}:{n.lineno} .{n.attr}" for n in ast.walk(tree)
                      if isinstance(n, ast.Attribute) and n.attr in ("config", "layout")]
    assert not reads, reads


def _cycle(graph):
    """One import cycle of ``graph`` ({module: imported modules}) as a list, or None."""
    state = {}

    def visit(m, path):
        state[m] = "open"
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n, path + [n])
                if found:
                    return found
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m, [m])
            if found:
                return found
    return None


def test_no_import_circle_through_the_hf_adapters_and_the_state_exchange():
    known = modules(ROOT)
    # the adapters, what sets them up and checks them, and the strategies they reach
    mine = {m: p for m, p in known.items() if m.startswith(("ds_seqpar.hf.linear", "ds_seqpar.hf.checks",
                                                            "ds_seqpar.hf.apply", "ds_seqpar.hf.hooks",
                                                            "ds_seqpar.strategies"))}
    graph = {m: imports_of(m, p, set(known))[0] & set(mine) - {m} for m, p in mine.items()}
    assert _cycle(graph) is None, _cycle(graph)
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
