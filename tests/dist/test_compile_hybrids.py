"""torch.compile over applied Hugging Face hybrids (docs/compile.md, "Hugging Face hybrids"): a gated DeltaNet
model (Qwen3.5: short convolution + delta rule), a Mamba2 one (Bamba: short convolution + SSD scan) and MiniMax's
lightning attention (its replaced forward calls the same op) compile with fullgraph=True (so no graph break;
the plain Qwen3.5 and Bamba have none under torch._dynamo.explain) and give the eager run's logits, loss and every parameter's gradient: under aot_eager with packed documents, under
inductor on rows of one document; ``ds_seqpar::linear_layer`` passes torch.library.opcheck.

Tolerance under aot_eager: the compiled graph runs the same operations (the linear layers' op bodies are the
eager path, their backward reruns it), so only the order of a few sums may differ: the trainer tests' bound
for fp32 runs that differ only in the order of sums, REL x the tensor's largest entry. Under inductor the
bound is derived (inductor_vs_eager)."""
import torch

from ..zoo.hybrids import batch, build, hybrid_config

REL = 1e-5
SEQ = 64
# each exchange once over the compiled tests: lasp allgather (gated DeltaNet, P=2), allscan (lightning, P=2) and
# linear_strategy ulysses (SSD, P=2) here, with packed documents; lasp_comm ring (SSD, P=4) under inductor below.
# At P=2 the world's two sequence groups run one family each (compiling is the cost: one per round)
ROUNDS = [[("qwen3_5_text", dict(size=2, strategy="ring")),
           ("bamba", dict(size=2, strategy="zigzag", linear_strategy="ulysses"))],
          # lightning attention (its replaced forward calls the same op), both linear strategies (lasp: All-Scan)
          [("minimax", dict(size=2, strategy="ring", lasp_comm="allscan")),
           ("minimax", dict(size=2, strategy="zigzag", linear_strategy="ulysses"))]]
# one linear layer and no softmax attention where the round is about the linear layer alone (compiling is the cost)
LAYERS = {"minimax": dict(layer_types=["linear_attention"], num_hidden_layers=1)}
# transformers' eager experts loop over the experts a batch hits (data-dependent: a graph break in the plain
# model too); batched_mm gathers each token's experts, the same operations eager and compiled
BATCHED_EXPERTS = {"minimax"}
# documents that cross the ranks' shards (32 tokens a rank) and start inside a chunk: the linear layers' op
# takes them as a tensor input and cuts at them on the host in its body
PACKED_BOUNDS = [0, 11, 40, 64]
REPACKED = [0, 30, 35, 64]         # the next step's packing: as many documents, other bounds (no new graph)


def _step(model_type, setting, state, backend=None, seq=SEQ, dtype=torch.float32, bounds=None, layers=None):
    from ds_seqpar import SequenceParallel
    from ds_seqpar.hf import apply_sequence_parallel
    cfg = hybrid_config(model_type, **(layers or {}))
    sp = SequenceParallel(setting)
    plain = build(cfg, dtype, state)
    if model_type in BATCHED_EXPERTS:
        plain.set_experts_implementation("batched_mm")
    model = apply_sequence_parallel(plain, sp)
    ids, labels = batch(cfg.vocab_size, rows=1, seq=seq)
    run = model
    if backend is not None:
        torch._dynamo.reset()
        run = torch.compile(model, backend=backend, fullgraph=True)
    packed = {} if bounds is None else {"cu_seqlens": torch.tensor(bounds)}
    batch_ = sp.shard_batch({"input_ids": ids, "labels": labels, **packed})
    sp.stats.reset()
    out = run(**batch_)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads, dict(sp.stats.calls), _repacked(run, sp, ids, labels, bounds)


def _repacked(run, sp, ids, labels, bounds):
    """(the loss of a forward on REPACKED documents, the graphs compiled for it), packed steps only."""
    if bounds is None:
        return None
    from torch._dynamo.utils import counters
    graphs = counters["stats"]["unique_graphs"]
    loss = run(**sp.shard_batch({"input_ids": ids, "labels": labels, "cu_seqlens": torch.tensor(REPACKED)})).loss
    return loss.detach(), counters["stats"]["unique_graphs"] - graphs


def _worst(got, want):
    """Largest |compiled - eager| / (REL x the eager tensor's largest entry); <= 1 passes."""
    bound = REL * want.abs().max().item()
    err = (got - want).abs().max().item()
    return err / bound if bound > 0 else (0.0 if err == 0 else float("inf"))


def compiled_vs_eager(rounds, bounds=None):
    """[(model type, setting, worst ratio, what, linear-layer gradients that are nonzero, eager calls per
    kind, compiled calls per kind)] on this rank: of each round, its sequence group's case; ``bounds``:
    packed documents (cu_seqlens, one row)."""
    from ds_seqpar import comm
    from ds_seqpar.hf.linear.families import linear_modules
    out = []
    for cases in rounds:
        model_type, setting = cases[comm.global_rank() // setting_size(cases) % len(cases)]
        layers = LAYERS.get(model_type)
        plain = build(hybrid_config(model_type, **(layers or {})), torch.float32)
        eager = _step(model_type, setting, plain.state_dict(), bounds=bounds, layers=layers)
        got = _step(model_type, setting, plain.state_dict(), "aot_eager", bounds=bounds, layers=layers)
        assert set(got[2]) == set(eager[2]), set(got[2]) ^ set(eager[2])
        ratios = {"logits": _worst(got[0], eager[0]), "loss": _worst(got[1], eager[1])}
        ratios.update({f"grad {n}": _worst(g, eager[2][n]) for n, g in got[2].items()})
        if bounds is not None:          # a new packing is new data for the compiled graph, not a new graph
            assert got[4][1] == 0, f"{model_type}: {got[4][1]} graph(s) compiled for a new packing"
            ratios["loss, repacked"] = _worst(got[4][0], eager[4][0])
        worst = max(ratios, key=ratios.get)
        # the linear layers' own parameters (conv, decays, dt bias, projections) get their gradient through the
        # op's backward
        prefixes = tuple(f"{n}." for n, _ in linear_modules(plain))
        linear = [n for n, g in got[2].items() if n.startswith(prefixes) and g.abs().max() > 0]
        out.append((model_type, setting, ratios[worst], worst, len(linear), eager[3], got[3]))
    return out


def setting_size(cases):
    return cases[0][1]["size"]


def test_applied_hybrids_compile_fullgraph_and_train_as_eager(pool):
    _check_compiled_vs_eager(pool.run(compiled_vs_eager, ROUNDS, PACKED_BOUNDS, timeout=600))


def _check_compiled_vs_eager(results):
    for rank, rows in enumerate(results):
        for model_type, setting, ratio, what, linear, eager_calls, compiled_calls in rows:
            assert ratio <= 1.0, f"rank {rank} {model_type} {setting}: {what} is {ratio:.3g}x the bound"
            assert linear >= 3, f"rank {rank} {model_type} {setting}: {linear} linear-layer gradients are nonzero"
            assert compiled_calls == _compiled_counts(eager_calls), (rank, model_type, setting, eager_calls,
                                                                     compiled_calls)


def _compiled_counts(eager_calls):
    """The op's backward reruns the forward exchange: its kinds count their forward calls again
    (lasp_state is forward only; conv_halo and linear_all_to_all count forward and backward alike)."""
    return dict(eager_calls, **{k: eager_calls[k] * 2 for k in ("lasp_state",) if k in eager_calls},
                **{k: eager_calls[k] * 3 // 2 for k in ("conv_halo", "linear_all_to_all") if k in eager_calls})


# -- inductor ------------------------------------------------------------------------------------------
# Inductor builds C++ kernels for what surrounds the opaque ops (norms, gates, MLP, the loss): minutes of
# compiling and lowering on this CPU. So one layer, the linear one (the attention op is compiled under
# inductor in test_compile.py), and every case has the same per-rank shapes (16 tokens a rank: 32 at P=2,
# 64 at P=4): the kernels' sources repeat, and with one cache directory a kernel is built once (the first
# rank takes its lock) and loaded by every other rank and round.
INDUCTOR_ROUNDS = [[("qwen3_5_text", dict(size=2, strategy="ring")),
                    ("bamba", dict(size=2, strategy="zigzag", linear_strategy="ulysses"))],
                   [("bamba", dict(size=4, strategy="ulysses", lasp_comm="ring"))]]
INDUCTOR_LAYERS = {"qwen3_5_text": dict(layer_types=["linear_attention"], num_hidden_layers=1),
                   "bamba": dict(num_hidden_layers=1, attn_layer_indices=[])}
INDUCTOR_TOKENS = 16


def inductor_vs_eager(rounds):
    """[(model type, setting, worst error / bound, what, eager calls, compiled calls)]: the eager fp32
    run's error against the same applied model in fp64 bounds the inductor run's (k = 10; 1e-5 x the
    largest entry as floor, for transformers' ops that compute in fp32 whatever the dtype): inductor's
    fused kernels sum in other orders and round transcendentals differently, by the fp32 rounding the
    eager run also makes. Inductor's cache is the machine's (TORCHINDUCTOR_CACHE_DIR), shared with
    test_compile.py's inductor cases: its CPU checks and wrapper builds, seconds per rank when cold, are paid
    once per session."""
    from ds_seqpar import comm

    torch._inductor.config.compile_threads = 1            # no compile workers: the ranks share two cores
    return [_inductor_case(*cases[comm.global_rank() // setting_size(cases) % len(cases)]) for cases in rounds]


def _inductor_case(model_type, setting):
    """One case of inductor_vs_eager on this rank."""
    from ..zoo.decoders import _worst
    seq, layers = INDUCTOR_TOKENS * setting["size"], INDUCTOR_LAYERS[model_type]
    state = build(hybrid_config(model_type, **layers), torch.float32).state_dict()
    ref = _step(model_type, setting, state, seq=seq, dtype=torch.float64, layers=layers)
    eager = _step(model_type, setting, state, seq=seq, layers=layers)
    got = _step(model_type, setting, state, "inductor", seq=seq, layers=layers)
    assert set(got[2]) == set(eager[2]) == set(ref[2]), set(got[2]) ^ set(eager[2])
    pairs = [("logits", got[0], ref[0], eager[0]), ("loss", got[1], ref[1], eager[1])]
    pairs += [(f"grad {n}", g, ref[2][n], eager[2][n]) for n, g in got[2].items()]
    ratios = {what: _worst(g, r, e, k=10.0, floor=1e-5) for what, g, r, e in pairs}
    worst = max(ratios, key=ratios.get)
    return model_type, setting, ratios[worst], worst, eager[3], got[3]


def test_applied_hybrids_compile_fullgraph_under_inductor(pool):
    results = pool.run(inductor_vs_eager, INDUCTOR_ROUNDS, timeout=600)
    for rank, rows in enumerate(results):
        assert len(rows) == len(INDUCTOR_ROUNDS)
        for model_type, setting, ratio, what, eager_calls, compiled_calls in rows:
            assert ratio <= 1.0, f"rank {rank} {model_type} {setting}: {what} is {ratio:.3g}x the bound"
            assert compiled_calls == _compiled_counts(eager_calls), (rank, model_type, setting)


# -- torch.library.opcheck of ds_seqpar::linear_layer ----------------------------------------------------


def linear_layer_opchecks(rounds, bounds):
    """[(model type, op name, packed)] checked by torch.library.opcheck on this rank: each seam call of
    one eager step of the applied model with packed documents (every input the op can take), as the
    compiled seam would pass it."""
    from unittest import mock

    from ds_seqpar import comm
    from ds_seqpar.hf.linear import opaque, seams
    calls = []

    def record(mixers, module, name, original, call):
        docs = mixers.documents and torch.tensor(mixers.documents)
        calls.append((mixers, module, name, original, {k: _detached(v) for k, v in call.items()}, docs))
        return opaque.run_seam(mixers, module, name, original, call)

    done = []
    for cases in rounds:
        model_type, setting = cases[comm.global_rank() // setting_size(cases) % len(cases)]
        state = build(hybrid_config(model_type), torch.float32).state_dict()
        with mock.patch.object(seams, "run_seam", record):
            _step(model_type, setting, state, bounds=bounds)
        first = {c[2]: c for c in reversed(calls)}          # each op's first call (the step's, not the repacked)
        for mixers, module, name, original, call, docs in first.values():
            _opcheck(mixers, module, name, original, call, docs)
            done.append((model_type, name, docs is not None))
    return done


def _detached(v):
    return v.detach().clone().requires_grad_(v.is_floating_point()) if isinstance(v, torch.Tensor) else v


def _opcheck(mixers, module, name, original, call, docs):
    """The forward op's schema, fake vs real and autograd registration; the backward op's schema and fake
    vs real. opcheck's AOT-dispatch sub-tests (static and dynamic shapes) also pass for the forward, but
    cost more than the rest of this file's compiles' share: the compiled tests here trace the op through AOT
    dispatch with static shapes anyway."""
    from ds_seqpar.hf.linear import opaque
    if docs is not None:
        call = dict(call, **{opaque.DOCUMENTS: docs})
    names = tuple(k for k, v in call.items() if isinstance(v, torch.Tensor))
    constants = tuple((k, v) for k, v in call.items() if not isinstance(v, torch.Tensor))
    tensors = [call[k] for k in names]
    key = opaque.key(mixers, module, name, original, names, constants)
    ops = torch.ops.ds_seqpar
    torch.library.opcheck(ops.linear_layer, (tensors, key),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    out = ops.linear_layer(tensors, key)
    plain = [None if t is None else t.detach() for t in tensors]
    torch.library.opcheck(ops.linear_layer_backward, (torch.randn_like(out), plain, key),
                          test_utils=("test_schema", "test_faketensor"))


def test_linear_layer_op_passes_opcheck(pool):
    for rank, done in enumerate(pool.run(linear_layer_opchecks, ROUNDS[:1], PACKED_BOUNDS, timeout=600)):
        names = {name for _, name, _ in done}
        assert len(names) == 2 and len(done) == 2 and all(p for *_, p in done), (rank, done)   # conv, mixer
