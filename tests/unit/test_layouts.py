"""Layouts are pure arithmetic: checked here without processes (docs/design.md, section 1)."""
import pytest
import torch

from ds_seqpar.masks import Mask
from ds_seqpar.cost.pairs import layout_pairs
from ds_seqpar.sharding.layouts import (LAYOUTS, ContiguousLayout, HybridLayout, Layout, StripedLayout,
                                        ZigzagLayout, make_layout)

from ..reference import pairs_per_query_set

# (name, ring_size, ulysses_size): every plain layout at P = 1..4, and 2D hybrids
CASES = [(name, p, 1) for name in LAYOUTS for p in (1, 2, 3, 4)]
CASES += [(name, r, u) for name in LAYOUTS for r, u in ((2, 2), (1, 4), (4, 1), (2, 3), (3, 2))]


def _id(case):
    name, r, u = case
    return f"{name}-{r}" if u == 1 else f"{name}-{r}x{u}"


@pytest.fixture(params=CASES, ids=_id)
def layout(request) -> Layout:
    return make_layout(*request.param)


def _lengths(layout):
    m = layout.required_multiple
    return [m, 3 * m, 5 * m * 2]


def _assert_equal(actual, expected, what):
    assert torch.equal(actual, expected), f"{what}:\n got      {actual.tolist()}\n expected {expected.tolist()}"


# -- permutation contract ----------------------------------------------------------------------

def test_permutation_is_a_permutation_with_equal_shares(layout):
    for n in _lengths(layout):
        perm = layout.permutation(n)
        assert perm.dtype == torch.int64, f"{layout}: permutation dtype {perm.dtype}"
        _assert_equal(perm.sort().values, torch.arange(n), f"{layout} N={n}: sorted permutation")
        per_rank = [layout.indices(n, r) for r in range(layout.size)]
        assert all(len(i) == n // layout.size for i in per_rank), \
            f"{layout} N={n}: unequal shares {[len(i) for i in per_rank]}"
        _assert_equal(torch.cat(per_rank), perm, f"{layout} N={n}: permutation vs indices")


def test_inverse_undoes_permutation(layout):
    for n in _lengths(layout):
        perm, inv = layout.permutation(n), layout.inverse(n)
        _assert_equal(perm[inv], torch.arange(n), f"{layout} N={n}: perm[inv]")
        _assert_equal(inv[perm], torch.arange(n), f"{layout} N={n}: inv[perm]")


@pytest.mark.parametrize("shape,dim", [((2, None, 3, 4), 1), ((None, 5), 0), ((2, 3, None), -1),
                                       ((3, None, 2), -2)])
def test_shard_then_unshard_is_identity(layout, shape, dim):
    n = 2 * layout.required_multiple
    x = torch.randn([n if s is None else s for s in shape], dtype=torch.float64)
    shards = [layout.shard(x, dim, r) for r in range(layout.size)]
    for r, s in enumerate(shards):
        _assert_equal(s, x.index_select(dim, layout.indices(n, r)), f"{layout} rank {r} shard")
    _assert_equal(layout.unshard(shards, dim), x, f"{layout} unshard(shard(x))")


def test_shard_accepts_non_contiguous_input_and_is_differentiable(layout):
    n = 2 * layout.required_multiple
    x = torch.randn(4, n, 3, dtype=torch.float64).transpose(0, 2).requires_grad_()  # [3, n, 4]
    weight = torch.randn(3, n, 4, dtype=torch.float64)
    shards = [layout.shard(x, 1, r) for r in range(layout.size)]
    _assert_equal(layout.unshard(shards, 1), x.detach(), f"{layout} non-contiguous round trip")
    (layout.unshard(shards, 1) * weight).sum().backward()
    _assert_equal(x.grad, weight, f"{layout} gradient through shard/unshard")


def test_position_ids_are_the_indices(layout):
    n = layout.required_multiple * 2
    pos = torch.arange(n).unsqueeze(0)  # [1, N], as an LM's position_ids
    for r in range(layout.size):
        _assert_equal(layout.shard(pos, 1, r)[0], layout.indices(n, r), f"{layout} rank {r}")


# -- hand-written examples ---------------------------------------------------------------------

@pytest.mark.parametrize("name,ring,ulysses,n,expected", [
    ("contiguous", 2, 1, 8, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("zigzag", 2, 1, 8, [[0, 1, 6, 7], [2, 3, 4, 5]]),
    ("striped", 2, 1, 8, [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("zigzag", 3, 1, 12, [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]]),
    ("striped", 3, 1, 6, [[0, 3], [1, 4], [2, 5]]),
    ("zigzag", 1, 1, 5, [[0, 1, 2, 3, 4]]),
    ("zigzag", 2, 2, 16, [[0, 1, 2, 3], [12, 13, 14, 15], [4, 5, 6, 7], [8, 9, 10, 11]]),
    ("striped", 2, 2, 8, [[0, 2], [4, 6], [1, 3], [5, 7]]),
    ("zigzag", 2, 3, 12, [[0, 1], [2, 9], [10, 11], [3, 4], [5, 6], [7, 8]]),
    ("zigzag", 1, 4, 8, [[0, 1], [2, 3], [4, 5], [6, 7]]),
])
def test_indices_match_hand_written_examples(name, ring, ulysses, n, expected):
    layout = make_layout(name, ring, ulysses)
    got = [layout.indices(n, r).tolist() for r in range(layout.size)]
    assert got == expected, f"{layout} N={n}: got {got}, expected {expected}"


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_hybrid_degenerates_to_ring_or_contiguous(name):
    for plain, hybrid in ((LAYOUTS[name](3), HybridLayout(LAYOUTS[name], 3, 1)),
                          (ContiguousLayout(4), HybridLayout(LAYOUTS[name], 1, 4))):
        n = plain.required_multiple * hybrid.required_multiple
        _assert_equal(hybrid.permutation(n), plain.permutation(n), f"{hybrid} vs {plain}")


def test_hybrid_ulysses_group_reassembles_the_ring_shard():
    for name in LAYOUTS:
        hybrid, ring = HybridLayout(LAYOUTS[name], 2, 3), LAYOUTS[name](2)
        n = hybrid.required_multiple
        for ring_rank in range(2):
            group = [hybrid.indices(n, ring_rank * 3 + u) for u in range(3)]
            _assert_equal(torch.cat(group), ring.indices(n, ring_rank),
                          f"{hybrid}: ulysses group of ring position {ring_rank}")
            assert hybrid.coords(ring_rank * 3 + 2) == (ring_rank, 2), f"{hybrid}.coords"


# -- validation --------------------------------------------------------------------------------

@pytest.mark.parametrize("layout,n,parts", [
    (ZigzagLayout(4), 1004, ["sequence length 1004", "zigzag", "2*size=8", "1000", "1008"]),
    (StripedLayout(3), 10, ["sequence length 10", "striped", "size=3", "9", "12", "pad"]),
    (ContiguousLayout(4), 2, ["sequence length 2", "contiguous", "size=4", "no valid length below",
                              "4"]),
    (make_layout("zigzag", 2, 3), 20, ["sequence length 20", "zigzag", "ulysses_size=3",
                                       "ring_size=2", "12", "24"]),
])
def test_validate_names_length_layout_divisor_and_nearest(layout, n, parts):
    with pytest.raises(ValueError) as err:
        layout.validate(n)
    for part in parts:
        assert part in str(err.value), f"{part!r} missing from: {err.value}"
    with pytest.raises(ValueError, match=f"sequence length {n}"):
        layout.shard(torch.zeros(2, n), 1, 0)


def test_required_multiples():
    got = {repr(lay): lay.required_multiple for lay in (
        ContiguousLayout(3), ZigzagLayout(3), ZigzagLayout(1), StripedLayout(4),
        make_layout("zigzag", 2, 3), make_layout("striped", 2, 2), make_layout("zigzag", 1, 3))}
    expected = dict(zip(got, [3, 6, 1, 4, 12, 4, 3]))
    assert got == expected, f"required_multiple: got {got}, expected {expected}"
    assert ZigzagLayout(4).validate(1008) == 1008, "a valid length is returned unchanged"


@pytest.mark.parametrize("bad", [0, -8, 8.0, "8", True])
def test_validate_rejects_non_positive_or_non_integer(bad):
    with pytest.raises(ValueError, match="positive integer"):
        StripedLayout(2).validate(bad)


def test_bad_names_sizes_ranks_and_shards_raise():
    with pytest.raises(ValueError) as err:
        make_layout("ringg", 2)
    assert all(name in str(err.value) for name in LAYOUTS), f"valid names not listed: {err.value}"
    for bad_size in (0, -1, 1.5):
        with pytest.raises(ValueError, match="positive integer"):
            ZigzagLayout(bad_size)
    with pytest.raises(ValueError, match="ulysses_size"):
        make_layout("zigzag", 2, 0)
    with pytest.raises(ValueError, match="rank 2 is out of range"):
        StripedLayout(2).indices(8, 2)
    with pytest.raises(ValueError, match="exactly 2 shards, got 3"):
        StripedLayout(2).unshard([torch.zeros(4)] * 3, 0)
    with pytest.raises(ValueError, match="same shape"):
        StripedLayout(2).unshard([torch.zeros(4), torch.zeros(3)], 0)
    with pytest.raises(ValueError, match="out of range"):
        StripedLayout(2).shard(torch.zeros(2, 8), 2, 0)


# -- load balance ------------------------------------------------------------------------------

def _brute_force_work(layout, n):
    """Per rank, the causal (q, k) pairs its queries see, counted pair by pair by the oracle."""
    return pairs_per_query_set(n, True, None, None, [layout.indices(n, r) for r in range(layout.size)])


def _causal_work(layout, n):
    """Per rank, the causal (q, k) pairs its queries see: the cost model's count (cost/pairs.py)."""
    return list(layout_pairs(layout, n, n, Mask(True)))


def test_causal_work_matches_brute_force(layout):
    n = 2 * layout.required_multiple
    assert _causal_work(layout, n) == _brute_force_work(layout, n), f"{layout} N={n}"


@pytest.mark.parametrize("p", [2, 3, 4])
def test_zigzag_balanced_striped_nearly_contiguous_not(p):
    n = 1024 * 3
    zig, stri, cont = (_causal_work(LAYOUTS[name](p), n) for name in ("zigzag", "striped", "contiguous"))
    total = n * (n + 1) // 2
    for name, work in (("zigzag", zig), ("striped", stri), ("contiguous", cont)):
        assert sum(work) == total, f"{name} P={p}: work {work} does not sum to {total}"
    assert len(set(zig)) == 1, f"zigzag P={p} must be exactly balanced: {zig}"
    per_rank = n // p
    assert max(stri) - min(stri) == per_rank * (p - 1), f"striped P={p}: spread {stri}"
    assert (max(stri) - min(stri)) / max(stri) < 2 * p / n, f"striped P={p} not nearly balanced"
    assert max(cont) / min(cont) > 2 * p - 1.1, f"contiguous P={p} should be imbalanced: {cont}"


# -- docstring pictures ------------------------------------------------------------------------

def causal_mask_picture(layout: Layout, seq_len: int) -> str:
    """The ASCII picture of the layouts' docstrings: owners, then the causal mask with rows
    (queries) and columns (keys) in rank-major order, x = attended; then work per rank."""
    n = layout.validate(seq_len)
    owned = [layout.indices(n, r).tolist() for r in range(layout.size)]
    owner = layout.inverse(n).div(n // layout.size, rounding_mode="floor").tolist()
    w, rw = len(str(n - 1)), len(f"r{layout.size - 1}")

    def cells(fn):
        return " | ".join(" ".join(f"{fn(k):>{w}}" for k in keys) for keys in owned)

    pad = " " * (rw + w + 4)
    header = cells(str)
    lines = ["rank of each token: " + " ".join(str(r) for r in owner), pad + header]
    for r, queries in enumerate(owned):
        if r:
            lines.append(pad + "".join("+" if ch == "|" else "-" for ch in header))
        for i, q in enumerate(queries):
            label = f"r{r}" if i == 0 else ""
            lines.append(f"{label:<{rw}}  {q:>{w}}  " + cells(lambda k: "x" if k <= q else "."))
    work = " ".join(f"r{r}={c}" for r, c in enumerate(_causal_work(layout, n)))
    return "\n".join(lines + [f"causal (q, k) pairs per rank: {work}"])


def _lines(text):
    return [line.strip() for line in text.strip().splitlines()]


@pytest.mark.parametrize("cls", [ContiguousLayout, ZigzagLayout, StripedLayout])
def test_docstring_picture_is_what_the_layout_does(cls):
    picture, doc = _lines(causal_mask_picture(cls(2), 8)), _lines(cls.__doc__)
    assert picture[0] in doc, f"{cls.__name__} docstring lacks {picture[0]!r}"
    start = doc.index(picture[0])
    assert doc[start:start + len(picture)] == picture, \
        f"{cls.__name__} docstring picture differs from:\n" + "\n".join(picture)
    hybrid = _lines(causal_mask_picture(make_layout("zigzag", 2, 2), 16))[0]
    assert hybrid in _lines(HybridLayout.__doc__), f"HybridLayout docstring lacks {hybrid!r}"
