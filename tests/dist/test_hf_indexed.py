"""DeepSeek sparse attention (hf/indexed.py) at P=2 and P=4 under every softmax strategy (and packed
documents under striped): logits, loss and every parameter gradient equal the unsharded model's (the
indexer's weights get none in either: transformers runs the indexer under no_grad), every query's top-k
set is the unsharded model's (ties included: the first queries see fewer keys than the top-k keeps, so
their rows pick among tied -inf scores; every P cuts those rows' keys differently), and the bytes are
closed_form.indexed_attention_bytes and the cost model's (cost/bytes.py); an indexer top-k longer than
the sequence is refused on every rank before any collective."""
import torch

from ds_seqpar import SequenceParallel
from ds_seqpar.cost.bytes import comm_per_layer
from ds_seqpar.cost.candidate import Candidate, Features
from ds_seqpar.cost.model_shape import from_hf_config
from ds_seqpar.strategies.closed_form import indexed_attention_bytes

from ..hf_models import tiny_model, unsharded_run
from .test_hf import BATCH, SEQ, _batch, _compare, _summed_grads

CASES = [{"strategy": s, "size": p} for p in (2, 4) for s in ("ulysses", "ring", "zigzag", "striped")]
KINDS = ("dsa_latent", "dsa_index_keys")


def _recorded_topk(model):
    """A list that every indexer's top-k indices [b, s, k] are appended to, in call order."""
    got = []
    for m in model.modules():
        if type(m).__name__.endswith("Indexer"):
            m.register_forward_hook(lambda mod, args, out: got.append(out))
    return got


def _unsharded_fp32(state, ids, labels):
    """unsharded_run's fp32 (logits, loss, grads), and the top-k indices of each layer's indexer."""
    from ..hf_models import textbook_loss
    model = tiny_model("deepseek_v32", state_dict=state)
    topk = _recorded_topk(model)
    logits = model(input_ids=ids, position_ids=torch.arange(SEQ).expand_as(ids)).logits
    loss = textbook_loss(logits, labels)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return (logits.detach(), loss.detach(), grads), topk


def check_indexed(cases):
    from ds_seqpar.hf import apply_sequence_parallel
    state = tiny_model("deepseek_v32").state_dict()
    ids, labels = _batch(tiny_model("deepseek_v32").config.vocab_size)
    ref = unsharded_run("deepseek_v32", state, ids, labels, torch.float64)
    plain, ref_topk = _unsharded_fp32(state, ids, labels)
    assert not any("indexer" in n for n in ref[2]), "transformers' indexer runs without gradient"
    cfg = tiny_model("deepseek_v32").config
    shape = from_hf_config(cfg)                       # the plan's cost model prices the same bytes (batch 1)
    checked = []
    for case in cases:
        sp = SequenceParallel(case)
        layer = indexed_attention_bytes(sp.size, BATCH, SEQ, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                        cfg.index_head_dim, 4)
        what = f"deepseek_v32 {case} sp_rank={sp.rank}"
        model = apply_sequence_parallel(tiny_model("deepseek_v32", state_dict=state), sp)
        topk = _recorded_topk(model)
        batch = sp.shard_batch({"input_ids": ids, "labels": labels})
        sp.stats.reset()
        out = model(**batch)
        out.loss.backward()
        sent = {k: sp.stats.bytes[k] for k in KINDS}
        assert sent == {k: cfg.num_hidden_layers * n for k, n in layer.items()}, f"{what}: bytes {sent} vs {layer}"
        priced = comm_per_layer(Candidate(case["strategy"], sp.size, 1, 0, Features()), shape, SEQ // sp.size, 4)
        assert sent == {k: cfg.num_hidden_layers * BATCH * n for k, n in priced["indexed"].items()}, (what, priced)
        for i, (mine, theirs) in enumerate(zip(topk, ref_topk)):
            whole = sp.unshard(mine, dim=1)                   # this rank's rows -> [b, N, k] global positions
            assert torch.equal(whole.sort(-1).values, theirs.sort(-1).values), f"{what}: layer {i} top-k sets differ"
        assert len(topk) == len(ref_topk) == cfg.num_hidden_layers, (len(topk), len(ref_topk))
        _compare(what, sp.unshard(out.logits.detach(), dim=1, seq_len=SEQ), out.loss.detach(),
                 _summed_grads(model, sp.group), ref, plain)
        checked.append(what)
    checked.append(_check_packed(state))
    return checked


def _check_packed(state):
    """Two packed documents (position_ids restarting at 0) under striped: the indexer and the attention
    keep to each document, as the unsharded model's packed-sequence mask does."""
    from ds_seqpar.hf import apply_sequence_parallel
    from ..hf_models import textbook_loss
    ids = _batch(96)[0][:1]
    pos = torch.cat([torch.arange(20), torch.arange(SEQ - 20)])[None]
    labels = ids.clone()
    labels[0, 20] = -100                      # the first document's last token has no target in the second
    ref = []
    for dtype in (torch.float64, torch.float32):
        model = tiny_model("deepseek_v32", dtype, state)
        logits = model(input_ids=ids, position_ids=pos).logits
        loss = textbook_loss(logits, labels)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        ref.append((logits.detach(), loss.detach(), grads))
    sp = SequenceParallel({"strategy": "striped", "size": 2})
    what = f"deepseek_v32 packed striped sp_rank={sp.rank}"
    model = apply_sequence_parallel(tiny_model("deepseek_v32", state_dict=state), sp)
    batch = sp.shard_batch({"input_ids": ids, "labels": labels, "position_ids": pos})
    assert "cu_seqlens" in batch, what
    out = model(**batch)
    out.loss.backward()
    _compare(what, sp.unshard(out.logits.detach(), dim=1, seq_len=SEQ), out.loss.detach(),
             _summed_grads(model, sp.group), ref[0], ref[1])
    return what


def test_indexed_attention_is_exact_under_every_strategy(pool):
    results = pool.run(check_indexed, CASES)
    assert all(len(r) == len(CASES) + 1 for r in results), results


def topk_refusal():
    """(message, collectives this rank's sp made) of a forward whose indexer keeps more keys than the sequence has."""
    from ds_seqpar.hf import UnsupportedModelError, apply_sequence_parallel
    sp = SequenceParallel({"strategy": "zigzag", "size": 2})
    model = apply_sequence_parallel(tiny_model("deepseek_v32", index_topk=SEQ + 1), sp)
    ids, labels = _batch(model.config.vocab_size)
    batch = sp.shard_batch({"input_ids": ids, "labels": labels})
    sp.stats.reset()
    try:
        model(**batch)
    except UnsupportedModelError as err:
        return str(err), dict(sp.stats.calls)
    return "no error", dict(sp.stats.calls)


def test_indexer_topk_longer_than_the_sequence_is_refused_on_every_rank(pool):
    for message, calls in pool.run(topk_refusal):
        assert f"config.index_topk={SEQ + 1}" in message and f"({SEQ} tokens" in message, message
        assert not calls, calls
