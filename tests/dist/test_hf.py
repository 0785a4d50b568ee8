"""Hugging Face models under every softmax strategy: logits, loss on every rank and parameter
gradients (summed over the sequence ranks, sp.loss's contract) equal the unsharded model's, with
tolerances derived from float64 and float32 runs of the unsharded model. One pool call per family
runs every strategy case, so the models are built once per rank."""
import pytest
import torch

from ds_seqpar import SequenceParallel, comm

from ..hf_models import tiny_model, unsharded_run
from ..reference import assert_derived_close

SEQ, BATCH = 32, 2
SOFTMAX_CASES = ([{"strategy": s, "size": p} for p in (2, 4) for s in ("ulysses", "ring", "zigzag", "striped")]
                 + [{"strategy": "ring", "size": 4, "ulysses_size": 2}])


def _batch(vocab):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[torch.rand(BATCH, SEQ, generator=g) < 0.2] = -100       # some ignored targets
    return ids, labels


def _summed_grads(model, group):
    """This rank's parameter gradients summed over the sequence group (one all-reduce)."""
    named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    flat = comm.all_reduce(torch.cat([p.grad.reshape(-1) for _, p in named]), group)
    out, i = {}, 0
    for n, p in named:
        out[n] = flat[i:i + p.numel()].view_as(p)
        i += p.numel()
    return out


def check_family(family, cases, checkpointing=False):
    """On every rank: each case on a fresh copy of one model, all kept applied until the end (several
    keys coexist); a bystander model stays untouched; remove_sequence_parallel restores each."""
    from ds_seqpar.hf import apply_sequence_parallel, remove_sequence_parallel
    state = tiny_model(family).state_dict()
    ids, labels = _batch(tiny_model(family).config.vocab_size)
    ref = unsharded_run(family, state, ids, labels, torch.float64)
    plain = unsharded_run(family, state, ids, labels, torch.float32)
    bystander = tiny_model(family, state_dict=state)
    applied, checked = [], []
    for cfg in cases:
        sp = SequenceParallel(cfg)
        model = tiny_model(family, state_dict=state)
        if checkpointing:
            model.gradient_checkpointing_enable()
            assert model.is_gradient_checkpointing
        assert apply_sequence_parallel(model, sp) is model
        what = f"{family} {cfg} checkpointing={checkpointing} sp_rank={sp.rank}"
        batch = sp.shard_batch({"input_ids": ids, "labels": labels})
        out = model(**batch)
        assert torch.equal(out.loss, sp.loss(out.logits, batch["labels"])), f"{what}: model(**batch).loss != sp.loss"
        out.loss.backward()
        _compare(what, sp.unshard(out.logits.detach(), dim=1, seq_len=SEQ), out.loss.detach(),
                 _summed_grads(model, sp.group), ref, plain)
        applied.append((sp, model, batch, out.logits.detach()))
        checked.append(what)
    # the first model still runs its own sp after the later registrations
    sp, model, batch, logits = applied[0]
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, logits), f"{family}: first applied model changed"
    for _, model, _, _ in applied:
        remove_sequence_parallel(model)
        assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
        _compare_plain(f"{family} after remove", model, ids, plain[0], ref[0])
    assert bystander.config._attn_implementation == "sdpa"
    _compare_plain(f"{family} bystander", bystander, ids, plain[0], ref[0])
    return checked


def _compare(what, logits, loss, grads, ref, plain):
    assert_derived_close(f"{what} logits", logits, ref[0], plain[0])
    assert_derived_close(f"{what} loss", loss, ref[1], plain[1])
    assert set(grads) == set(ref[2]), f"{what}: gradients for {sorted(set(ref[2]) ^ set(grads))} missing or extra"
    for name, g in grads.items():
        assert_derived_close(f"{what} grad {name}", g, ref[2][name], plain[2][name])


def _compare_plain(what, model, ids, plain_logits, ref_logits):
    with torch.no_grad():
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        logits = model(input_ids=ids, position_ids=pos).logits
    assert_derived_close(f"{what} logits", logits, ref_logits, plain_logits)


@pytest.mark.parametrize("family", ["llama", "qwen2", "granite"])
def test_every_strategy_matches_unsharded_model(pool, family):
    results = pool.run(check_family, family, SOFTMAX_CASES)
    assert all(len(r) == len(SOFTMAX_CASES) for r in results), results


def test_gradient_checkpointing_recomputes_exactly(pool):
    cases = [{"strategy": "zigzag", "size": 2}, {"strategy": "ulysses", "size": 4},
             {"strategy": "striped", "size": 4, "ulysses_size": 2}]
    results = pool.run(check_family, "llama", cases, True)
    assert all(len(r) == len(cases) for r in results), results


def test_mla_value_head_size_is_padded_exactly(pool):
    """DeepSeek-V3: v head 8, q/k head 24 (nope 16 + rope 8)."""
    cases = [{"strategy": "ulysses", "size": 2}, {"strategy": "zigzag", "size": 4}]
    results = pool.run(check_family, "deepseek_v3", cases)
    assert all(len(r) == len(cases) for r in results), results
