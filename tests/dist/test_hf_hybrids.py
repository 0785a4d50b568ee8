"""Hybrid models (gated DeltaNet, Kimi delta attention, Mamba2 SSD, short convolutions next to softmax attention)
under sequence parallelism on the shared pool: logits, loss and every parameter gradient equal the
unsharded model (tests/zoo/hybrids.py derives the bound), for each family, both state exchanges
(lasp_comm allgather / ring / allscan), linear_strategy ulysses, softmax strategies ulysses, ring and zigzag,
P = 2 and 4; what cannot be exact is refused by name on every rank."""
import pytest

from ..zoo.hybrids import check_hybrid, check_hybrids, check_packed
from .test_lasp import scan_blocks_of

P2 = dict(size=2)
P4 = dict(size=4)
# the headline family gets the whole matrix; the others one P=2 and one P=4 setting, varied
FULL = [dict(P2, strategy="ring"), dict(P2, strategy="ring", lasp_comm="ring"), dict(P2, strategy="zigzag"),
        dict(P2, strategy="ulysses", linear_strategy="ulysses"), dict(P4, strategy="zigzag", lasp_comm="ring"),
        dict(P4, strategy="ulysses"), dict(P4, strategy="ring", linear_strategy="ulysses"),
        dict(P2, strategy="ring", lasp_comm="allscan"), dict(P4, strategy="zigzag", lasp_comm="allscan")]
CASES = [
    ("qwen3_5_text", FULL),
    ("qwen3_next", [dict(P2, strategy="zigzag", lasp_comm="ring"), dict(P4, strategy="ring")]),
    ("qwen3_5_moe_text", [dict(P2, strategy="ulysses"), dict(P4, strategy="zigzag", linear_strategy="ulysses")]),
    ("olmo_hybrid", [dict(P2, strategy="ring", linear_strategy="ulysses"), dict(P4, strategy="zigzag", lasp_comm="ring")]),
    ("kimi_linear", [dict(P2, strategy="ring"), dict(P4, strategy="zigzag", lasp_comm="ring")]),
    ("bailing_hybrid", [dict(P2, strategy="zigzag", linear_strategy="ulysses"), dict(P4, strategy="ring")]),
    ("bamba", [dict(P2, strategy="ring", lasp_comm="ring"), dict(P4, strategy="zigzag", lasp_comm="allscan")]),
    ("granitemoehybrid", [dict(P2, strategy="zigzag", linear_strategy="ulysses"), dict(P4, strategy="ring")]),
    ("nemotron_h", [dict(P2, strategy="ulysses"), dict(P4, strategy="zigzag", lasp_comm="ring")]),
    ("falcon_h1", [dict(P2, strategy="zigzag", lasp_comm="ring"), dict(P4, strategy="ulysses")]),
    ("minimax", [dict(P2, strategy="zigzag", linear_strategy="ulysses"), dict(P4, strategy="ring", lasp_comm="ring"),
                 dict(P4, strategy="zigzag", lasp_comm="allscan")]),
    ("lfm2", [dict(P2, strategy="zigzag"), dict(P4, strategy="ulysses")]),
    ("lfm2_moe", [dict(P2, strategy="ring"), dict(P4, strategy="zigzag")]),
    ("lfm3", [dict(P2, strategy="ulysses"), dict(P4, strategy="ring")]),
]
# Mamba-1 selective scans (a diagonal transition): each state exchange and the channels split by ulysses;
# Mamba2 with one B/C group for every head (Bamba, Granite-4.0-H, Mamba2 checkpoints): ulysses repeats it per
# rank. None may be refused.
SCANS = [
    ("mamba", [dict(P2, strategy="ring"), dict(P2, strategy="zigzag", lasp_comm="ring"),
               dict(P2, strategy="ring", linear_strategy="ulysses"), dict(P4, strategy="zigzag", lasp_comm="allscan")]),
    ("falcon_mamba", [dict(P2, strategy="zigzag"), dict(P2, strategy="ring", lasp_comm="ring"),
                      dict(P2, strategy="ulysses", linear_strategy="ulysses")]),
    ("jamba", [dict(P2, strategy="zigzag"), dict(P2, strategy="ulysses", lasp_comm="ring"),
               dict(P2, strategy="ring", linear_strategy="ulysses")]),
    ("zamba", [dict(P2, strategy="ulysses"), dict(P2, strategy="zigzag", lasp_comm="ring"),
               dict(P2, strategy="ring", linear_strategy="ulysses")]),
    ("bamba, n_groups=1", [dict(P2, strategy="ring", linear_strategy="ulysses"),
                           dict(P4, strategy="ulysses", linear_strategy="ulysses")]),
]


@pytest.fixture(scope="module")
def results(pool):
    return pool.run(scan_blocks_of, check_hybrids, CASES, timeout=900)


@pytest.mark.parametrize("model_type", [mt for mt, _ in CASES])
def test_hybrid_family_is_exact(results, model_type):
    for rank in (0, 2) if any(s["size"] == 2 for _, ss in CASES for s in ss) else (0,):
        for setting, ratio, what in results[rank][model_type]:
            if ratio is None and "not divisible by sequence_parallel.size" in what:
                continue            # linear_strategy ulysses with fewer heads than ranks: refused by name
            assert ratio is not None, (model_type, setting, what)
            assert ratio <= 1.0, f"{model_type} {setting}: {what} is {ratio:.3g}x the bound"
    assert results[0][model_type] == results[1][model_type] or all(
        a[1] is not None for a in results[0][model_type])


def test_mamba1_scans_and_shared_groups_are_exact(pool):
    results = pool.run(scan_blocks_of, check_hybrids, SCANS, False, True, timeout=900)
    for mt, settings in SCANS:
        for rank in (0, 2) if all(s["size"] == 2 for s in settings) else (0,):
            assert len(results[rank][mt]) == len(settings)
            for setting, ratio, what in results[rank][mt]:
                assert ratio is not None and ratio <= 1.0, (mt, setting, ratio, what)
        assert results[1][mt] == results[0][mt], mt          # the two ranks of one group


def _scan_refusals():
    """Mamba-1 settings that cannot be exact: striped runs, and 90 channels that ulysses cannot split over 4 ranks."""
    import torch
    from ds_seqpar import SequenceParallel
    from ds_seqpar.hf import apply_sequence_parallel
    from ..zoo.hybrids import batch, build, hybrid_config, seq_of
    out = {}
    for name, setting, over in (("striped", dict(strategy="striped", size=2), {}),
                                ("channels", dict(strategy="ring", size=4, linear_strategy="ulysses"),
                                 dict(intermediate_size=90))):
        cfg = hybrid_config("mamba", **over)
        sp = SequenceParallel(setting)
        ids, labels = batch(cfg.vocab_size, seq=seq_of("mamba"))
        out[name] = _said(lambda: apply_sequence_parallel(build(cfg, torch.float32), sp)(
            **sp.shard_batch({"input_ids": ids, "labels": labels})), "ran")
    return out


def test_mamba1_refusals_name_the_scan_on_every_rank(pool):
    results = pool.run(_scan_refusals)
    assert all(r == results[0] for r in results)
    got = results[0]
    assert "striped" in got["striped"] and "Mamba-1 selective scan" in got["striped"], got["striped"]
    assert "90 channels" in got["channels"] and "sequence_parallel.size=4" in got["channels"] \
        and "linear_strategy 'lasp'" in got["channels"], got["channels"]


def test_ranks_agree_and_refusals_name_the_key(results):
    """Every rank of a group gets the same verdicts; heads that ulysses cannot split are named."""
    for mt, _ in CASES:
        verdicts = [[(str(s), r is None) for s, r, _ in res[mt]] for res in results]
        assert all(v == verdicts[0] for v in verdicts), mt
    refused = [what for res in results for mt, _ in CASES for _, r, what in res[mt] if r is None]
    assert all("linear_strategy" in w for w in refused), refused


def _refusals():
    import torch
    from ds_seqpar import SequenceParallel
    from ds_seqpar.hf import apply_sequence_parallel
    from ..zoo.hybrids import batch, build, hybrid_config
    cfg = hybrid_config("qwen3_5_text")
    ids, labels = batch(cfg.vocab_size, rows=2)
    out = {}
    for name, setting in (("striped", dict(strategy="striped", size=2)), ("lasp", dict(strategy="lasp", size=2))):
        out[name] = _said(lambda: apply_sequence_parallel(build(cfg, torch.float32), SequenceParallel(setting)),
                          "applied")
    sp = SequenceParallel(dict(strategy="ring", size=2))
    model = apply_sequence_parallel(build(cfg, torch.float32), sp)
    b = sp.shard_batch({"input_ids": ids, "labels": labels})
    packed = dict(b, position_ids=b["position_ids"] % 50)           # documents restarting at 0, 2 rows
    for name, kwargs in (("packed", packed), ("cache", dict(b, use_cache=True))):
        out[name] = _said(lambda: model(**kwargs), "ran")
    return out


def _said(call, done: str) -> str:
    """``done`` when ``call()`` goes through, else the ConfigError's message (what a refusal says)."""
    from ds_seqpar.config import ConfigError
    try:
        call()
        return done
    except ConfigError as err:
        return str(err)


def test_what_cannot_be_exact_is_refused_by_name_on_every_rank(pool):
    results = pool.run(_refusals)
    assert all(r == results[0] for r in results)
    got = results[0]
    assert "strategy='striped'" in got["striped"] and "ulysses, ring or zigzag" in got["striped"]
    assert "strategy='lasp'" in got["lasp"] and "linear_strategy" in got["lasp"]
    assert "packed documents need batch size 1" in got["packed"], got["packed"]


def _bypass_and_broken_halo():
    """A seam the layer bypasses is refused after its forward; a halo that is wrong (zeros) is
    caught by the exactness check: the tests can fail."""
    import sys
    import torch
    from ds_seqpar import SequenceParallel
    from ds_seqpar.config import ConfigError
    from ds_seqpar.hf import apply_sequence_parallel
    from ds_seqpar.strategies import linear_exchange
    from ..zoo.hybrids import batch, build, hybrid_config
    cfg = hybrid_config("lfm2")
    sp = SequenceParallel(dict(strategy="ring", size=2))
    model = apply_sequence_parallel(build(cfg, torch.float32), sp)
    ids, labels = batch(cfg.vocab_size, rows=1)
    module = sys.modules[type(model.model.layers[0].conv).__module__]
    seam = module.causal_conv1d_fn
    module.causal_conv1d_fn = seam._ds_seqpar_original                   # another kernel swapped in
    try:
        model(**sp.shard_batch({"input_ids": ids, "labels": labels}))
        bypass = "ran"
    except ConfigError as err:
        bypass = str(err)
    finally:
        module.causal_conv1d_fn = seam
    real = linear_exchange.halos
    used = []
    def zeros(x, w, *a, **k):
        used.append(1)
        return [torch.zeros_like(h) for h in real(x, w, *a, **k)]
    linear_exchange.halos = zeros
    try:
        broken = check_hybrid("lfm2", [dict(strategy="ring", size=2)])[0][1]
    finally:
        linear_exchange.halos = real
    return bypass, broken, len(used)


def test_a_bypassed_seam_and_a_wrong_halo_are_caught(pool):
    bypass, broken, used = pool.run(_bypass_and_broken_halo)[0]
    assert "bypassed the sequence-parallel seam" in bypass
    assert used == 1 and broken > 10.0, (used, broken)


def test_gradient_checkpointing_recomputes_the_exchanges_exactly(pool):
    res = pool.run(check_hybrid, "qwen3_5_text", [dict(strategy="zigzag", size=2, lasp_comm="ring")], True)
    (setting, ratio, what), = res[0]
    assert ratio is not None and ratio <= 1.0, (setting, ratio, what)


def _bytes(setting, model_type="qwen3_5_text"):
    """Bytes per kind of one forward + backward of a tiny hybrid (one linear layer) and the closed forms
    for its linear layer and conv: gated DeltaNet (a K x K transition), Mamba2 SSD (a data-dependent
    decay per head), lightning attention (a constant decay per head, no conv) and Mamba-1 (a diagonal
    transition as large as the state; one Mamba layer)."""
    import torch
    from ds_seqpar import SequenceParallel
    from ds_seqpar.hf import apply_sequence_parallel
    from ds_seqpar.strategies.closed_form import conv_halo_bytes, linear_state_bytes, linear_ulysses_bytes
    from ds_seqpar.strategies.lasp_chain import fragments
    from ds_seqpar.strategies.ulysses import kv_replication
    from ..zoo.hybrids import batch, build, hybrid_config, seq_of
    cfg = hybrid_config(model_type, **({"num_hidden_layers": 1} if model_type == "mamba" else {}))
    sp = SequenceParallel(setting)
    model = apply_sequence_parallel(build(cfg, torch.float32), sp)
    seq = seq_of(model_type)
    ids, labels = batch(cfg.vocab_size, seq=seq)
    b = sp.shard_batch({"input_ids": ids, "labels": labels})
    sp.stats.reset()
    model(**b).loss.backward()
    frags, rows, tokens = fragments(sp.layout, seq), ids.shape[0], ids.shape[0] * seq // sp.size
    if model_type.startswith("bamba"):      # x and the output; dt; B and C (groups repeated to split over ranks)
        h, pd, n, g = cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_d_state, cfg.mamba_n_groups
        sent = g * kv_replication(h, g, sp.size)
        state, kind, elems = (h, pd, n), "scalar", [tokens * h * pd] * 2 + [tokens * h] + [tokens * sent * n] * 2
        halo = (cfg.mamba_expand * cfg.hidden_size + 2 * g * n, cfg.mamba_d_conv - 1)
    elif model_type == "mamba":             # x, dt, z and the output per channel; B and C (one group) to every rank
        c, n = cfg.intermediate_size, cfg.state_size
        state, kind, elems = (c, n, 1), "diagonal", [tokens * c] * 4 + [tokens * sp.size * n] * 2
        halo = (c, cfg.conv_kernel - 1)
    elif model_type == "minimax":           # q, k, v and the output
        h, d = cfg.num_attention_heads, cfg.head_dim
        state, kind, elems, halo = (h, d, d), "fixed", [tokens * h * d] * 4, None
    else:                                   # q, k; v and the output; g, beta
        hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                          cfg.linear_value_head_dim)
        state, kind = (hv, dk, dv), "matrix"
        elems = [tokens * hk * dk] * 2 + [tokens * hv * dv] * 2 + [tokens * hv] * 2
        halo = (2 * hk * dk + hv * dv, cfg.linear_conv_kernel_dim - 1)
    if sp.config.linear_strategy == "ulysses":
        want = linear_ulysses_bytes(sp.size, elems, 4)
    else:
        want = linear_state_bytes(frags, sp.rank, rows, *state, sp.config.lasp_comm, kind)
    if halo:
        want.update(conv_halo_bytes(frags, rows, halo[0], halo[1], 4))
    got = {k: sp.stats.bytes.get(k, 0) for k in want}
    if model_type == "mamba" and sp.config.lasp_comm == "allgather":     # the cost model prices LASP-2 and ulysses
        _check_cost_model(sp, cfg, seq, rows, got)
    return got, want


def _check_cost_model(sp, cfg, seq, rows, got):
    """The plan's cost model (cost/bytes.py on the shape read from the config) against the measured bytes."""
    from ds_seqpar.cost.bytes import comm_per_layer
    from ds_seqpar.cost.candidate import Candidate, Features
    from ds_seqpar.cost.model_shape import from_hf_config
    c = Candidate(sp.config.strategy, sp.size, 1, 0, Features(), sp.config.linear_strategy)
    priced = comm_per_layer(c, from_hf_config(cfg), seq // sp.size, 4)["mamba"]
    assert got == {k: rows * v for k, v in priced.items()}, (sp.config, got, priced)


@pytest.mark.parametrize("model_type,setting", [
    ("qwen3_5_text", dict(strategy="ring", size=2)), ("qwen3_5_text", dict(strategy="zigzag", size=4, lasp_comm="ring")),
    ("qwen3_5_text", dict(strategy="ulysses", size=2, linear_strategy="ulysses")),
    ("bamba", dict(strategy="zigzag", size=2)), ("bamba", dict(strategy="ring", size=4, lasp_comm="ring")),
    ("bamba, n_groups=1", dict(strategy="ulysses", size=4, linear_strategy="ulysses")),
    ("mamba", dict(strategy="zigzag", size=2)), ("mamba", dict(strategy="ring", size=2, lasp_comm="ring")),
    ("mamba", dict(strategy="ring", size=2, linear_strategy="ulysses")),
    ("qwen3_5_text", dict(strategy="zigzag", size=4, lasp_comm="allscan")),
    ("bamba", dict(strategy="ring", size=4, lasp_comm="allscan")), ("mamba", dict(strategy="ring", size=4, lasp_comm="allscan")),
    ("minimax", dict(strategy="zigzag", size=4)), ("minimax", dict(strategy="zigzag", size=4, lasp_comm="allscan")),
    ("minimax", dict(strategy="ring", size=2, linear_strategy="ulysses"))])
def test_linear_layer_bytes_equal_the_closed_forms(pool, model_type, setting):
    for got, want in pool.run(scan_blocks_of, _bytes, setting, model_type):
        assert got == want and all(v > 0 for v in want.values()), (got, want)


# documents: [0,2) shorter than the conv halo; [2,39) crosses rank boundary 38 (P=4); [39,40) one token,
# starting inside rank 1's first K-1 tokens; [40,130) crosses 76 and 114; [130,131); [131,152).
# The second set: a document starting exactly at a rank boundary (76), one of one token after it.
CROSSING = [0, 2, 39, 40, 130, 131, 152]
AT_BOUNDARY = [0, 76, 77, 152]
PACKED = [("qwen3_5_text", CROSSING, [dict(P4, strategy="ring"), dict(P4, strategy="zigzag", lasp_comm="ring"),
                                      dict(P2, strategy="ulysses", linear_strategy="ulysses")]),
          ("qwen3_5_text", AT_BOUNDARY, [dict(P2, strategy="ring", lasp_comm="ring"), dict(P4, strategy="zigzag")]),
          ("qwen3_5_text", CROSSING, [dict(P4, strategy="zigzag", lasp_comm="allscan")]),
          ("kimi_linear", CROSSING, [dict(P4, strategy="zigzag")]),
          ("bamba", CROSSING, [dict(P4, strategy="ring", lasp_comm="ring"), dict(P2, strategy="zigzag", linear_strategy="ulysses")]),
          ("minimax", CROSSING, [dict(P4, strategy="zigzag"), dict(P4, strategy="ring", lasp_comm="allscan")]),
          ("lfm2", AT_BOUNDARY, [dict(P4, strategy="ring")])]


def _packed_all(cases):
    return [check_packed(mt, settings, bounds) for mt, bounds, settings in cases]


def test_packed_documents_equal_each_document_run_alone(pool):
    """The state and the conv halo restart at every document start, wherever it falls."""
    for results in pool.run(scan_blocks_of, _packed_all, PACKED, timeout=600):
        for (mt, bounds, _), rows in zip(PACKED, results):
            for setting, ratio, what in rows:
                assert ratio <= 1.0, f"{mt} {bounds} {setting}: {what} is {ratio:.3g}x the bound"
