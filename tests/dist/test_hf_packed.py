"""A Hugging Face model on packed documents: the sharded batch from sp.shard_batch (position_ids
restarting at 0 -> global cu_seqlens) goes through model(**batch) unchanged, and the gathered logits,
the loss and the parameter gradients equal those of the same documents run one per row."""
import torch

from ds_seqpar import SequenceParallel

from ..hf_models import tiny_model
from ..reference import assert_derived_close
from .test_hf import _summed_grads

DOC_LENS = (7, 12, 3, 10)          # odd, shorter than a shard, one spanning ranks; N = 32
CASES = [{"strategy": s, "size": p} for p in (2, 4) for s in ("ulysses", "ring", "zigzag", "striped")]


def _packed_row(vocab):
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, vocab, (n,), generator=g) for n in DOC_LENS]
    pos = torch.cat([torch.arange(n) for n in DOC_LENS])[None]
    return docs, torch.cat(docs)[None], pos


def _one_per_row(state, docs, dtype):
    """Logits (concatenated), the mean next-token loss within documents, and the gradients."""
    model = tiny_model("llama", dtype, state)
    logits = [model(input_ids=d[None], position_ids=torch.arange(len(d))[None]).logits[0] for d in docs]
    sums = [torch.nn.functional.cross_entropy(lg[:-1], d[1:], reduction="sum") for lg, d in zip(logits, docs)]
    loss = torch.stack(sums).sum() / sum(len(d) - 1 for d in docs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.cat(logits).detach(), loss.detach(), grads


def _check_packed(cases, drop_cu_seqlens=False):
    """``drop_cu_seqlens``: call the model with input_ids and position_ids only (restarting at 0), as
    plain transformers packs rows: the applied model must find the documents itself."""
    from ds_seqpar.hf import apply_sequence_parallel
    state = tiny_model("llama").state_dict()
    docs, ids, pos = _packed_row(tiny_model("llama").config.vocab_size)
    ref, plain = _one_per_row(state, docs, torch.float64), _one_per_row(state, docs, torch.float32)
    for cfg in cases:
        sp = SequenceParallel(cfg)
        model = apply_sequence_parallel(tiny_model("llama", state_dict=state), sp)
        batch = sp.shard_batch({"input_ids": ids, "labels": ids, "position_ids": pos})
        assert batch["cu_seqlens"].tolist() == [0, 7, 19, 22, 32], batch["cu_seqlens"]
        labels = batch.pop("labels")
        if drop_cu_seqlens:
            del batch["cu_seqlens"]
        out = model(**batch)
        loss = sp.loss(out.logits, labels)
        loss.backward()
        what = f"packed {cfg} sp_rank={sp.rank}"
        assert_derived_close(f"{what} logits", sp.unshard(out.logits.detach(), dim=1, seq_len=ids.shape[1])[0],
                             ref[0], plain[0])
        assert_derived_close(f"{what} loss", loss.detach(), ref[1], plain[1])
        for name, g in _summed_grads(model, sp.group).items():
            assert_derived_close(f"{what} grad {name}", g, ref[2][name], plain[2][name])
    return len(cases)


def test_packed_documents_equal_one_document_per_row(pool):
    assert pool.run(_check_packed, CASES) == [len(CASES)] * 4


def test_packed_rows_without_cu_seqlens_find_their_documents(pool):
    """The trap: position_ids restarting at 0 but no cu_seqlens (plain transformers masks documents
    from position_ids alone); the pre-hook gathers them and passes the documents."""
    cases = [{"strategy": "zigzag", "size": 2}, {"strategy": "ulysses", "size": 4}, {"strategy": "ring", "size": 4}]
    assert pool.run(_check_packed, cases, True) == [len(cases)] * 4


# -- right padding (the collators' default): dropped for causal models, exact on the real tokens -----

PAD_LENS = (32, 19)                # row 1: 13 pads on the right


def _padded_reference(state, ids, mask, labels, dtype):
    """The unsharded model with its padding mask: real-token logits, the loss, the gradients."""
    from ..hf_models import textbook_loss
    model = tiny_model("llama", dtype, state)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=torch.arange(ids.shape[1]).expand_as(ids)).logits
    loss = textbook_loss(logits, labels)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach()[mask.bool()], loss.detach(), grads


def _check_right_padding(cases):
    from ds_seqpar.hf import apply_sequence_parallel
    state = tiny_model("llama").state_dict()
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(4))
    mask = torch.stack([(torch.arange(32) < n).long() for n in PAD_LENS])
    labels = ids.masked_fill(mask == 0, -100)                    # HF collators ignore the pads' targets
    ref = _padded_reference(state, ids, mask, labels, torch.float64)
    plain = _padded_reference(state, ids, mask, labels, torch.float32)
    for cfg in cases:
        sp = SequenceParallel(cfg)
        model = apply_sequence_parallel(tiny_model("llama", state_dict=state), sp)
        batch = sp.shard_batch({"input_ids": ids, "labels": labels, "attention_mask": mask})
        out = model(**batch)
        out.loss.backward()
        what = f"right padding {cfg} sp_rank={sp.rank}"
        logits = sp.unshard(out.logits.detach(), dim=1, seq_len=32)[mask.bool()]
        assert_derived_close(f"{what} logits", logits, ref[0], plain[0])
        assert_derived_close(f"{what} loss", out.loss.detach(), ref[1], plain[1])
        for name, g in _summed_grads(model, sp.group).items():
            assert_derived_close(f"{what} grad {name}", g, ref[2][name], plain[2][name])
    return len(cases)


def test_right_padding_is_dropped_exactly_for_causal_models(pool):
    cases = [{"strategy": "zigzag", "size": 2}, {"strategy": "striped", "size": 4}, {"strategy": "ulysses", "size": 4}]
    assert pool.run(_check_right_padding, cases) == [len(cases)] * 4
