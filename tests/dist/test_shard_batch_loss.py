"""sp.shard_batch (labels shifted over the whole sequence, then sharded in the layout) and sp.loss
(global mean, identical on every rank, backward = this rank's share)."""
import pytest
import torch
import torch.nn.functional as F

from ds_seqpar import SequenceParallel
from ds_seqpar.sharding.batch import IGNORE_INDEX, shard_batch, shift_labels

from ..e2e.test_train_e2e import SHIPPED, shipped_config

N, B, V = 48, 2, 11


def test_shift_labels_moves_targets_left_and_ignores_the_last():
    labels = torch.tensor([[5, 6, 7, 8], [1, -100, 3, 4]])
    assert shift_labels(labels).tolist() == [[6, 7, 8, -100], [-100, 3, 4, -100]]


def test_shard_batch_without_sp_only_shifts_and_adds_positions():
    ids = torch.arange(8).view(2, 4)
    out = shard_batch({"input_ids": ids})
    assert out["labels"].tolist() == [[1, 2, 3, -100], [5, 6, 7, -100]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3]] * 2


def global_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (B, N), generator=g)
    labels = ids.clone()
    labels[torch.rand(B, N, generator=g) < 0.2] = IGNORE_INDEX
    mask = (torch.rand(B, N, generator=g) < 0.9).long()
    return {"input_ids": ids, "labels": labels, "attention_mask": mask, "doc_id": "not a tensor"}


def _shard_batch_case(sp_section):
    sp = SequenceParallel(sp_section)
    batch = global_batch()
    local = sp.shard_batch(batch)
    pos = local["position_ids"]
    assert torch.equal(pos, sp.position_ids(N).expand(B, -1)), "position_ids are not the layout's positions"
    assert torch.equal(local["input_ids"], batch["input_ids"][:, pos[0]]), "input_ids not sharded in the layout"
    assert torch.equal(local["attention_mask"], batch["attention_mask"][:, pos[0]]), "mask not sharded alike"
    assert local["doc_id"] == "not a tensor"
    return sp.dp_rank, pos[0].tolist(), local["labels"].tolist()


@pytest.mark.parametrize("name", SHIPPED)
def test_every_token_keeps_its_target_across_shard_edges(pool, name):
    results = pool.run(_shard_batch_case, shipped_config(name)["sequence_parallel"])
    batch = global_batch()
    want = shift_labels(batch["labels"])
    for dp_rank in {r[0] for r in results}:
        got = torch.full((B, N), 12345)
        for _, positions, labels in (r for r in results if r[0] == dp_rank):
            got[:, positions] = torch.tensor(labels)
        # any token whose successor lives on another rank (a shard edge) still has it as target
        assert torch.equal(got, want), f"{name}: reassembled labels differ from the whole-sequence shift"


def _loss_case(size, grad_scale, all_ignored):
    sp = SequenceParallel({"strategy": "ulysses", "size": size})
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(B, N, V, generator=g, dtype=torch.float64).float().requires_grad_()
    labels = torch.randint(0, V, (B, N), generator=g)
    labels[torch.rand(B, N, generator=g) < (1.1 if all_ignored else 0.3)] = IGNORE_INDEX
    full = F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=IGNORE_INDEX)
    if all_ignored:
        full = full.nan_to_num(0.0)
    full.backward()
    local = sp.shard(logits.detach()).requires_grad_()
    loss = sp.loss(local, sp.shard(labels), grad_scale=grad_scale)
    loss.backward()
    torch.testing.assert_close(loss, full.detach(), rtol=1e-6, atol=1e-7, msg=lambda m: f"loss value: {m}")
    torch.testing.assert_close(local.grad, sp.shard(logits.grad) * grad_scale, rtol=1e-5, atol=1e-8,
                               msg=lambda m: f"rank {sp.rank}: local gradient is not its share: {m}")
    return sp.dp_rank, loss.item()


@pytest.mark.parametrize("size,grad_scale,all_ignored",
                         [(2, 1.0, False), (4, 1.0, False), (2, 2.0, False), (4, 1.0, True)])
def test_loss_is_the_global_mean_on_every_rank(pool, size, grad_scale, all_ignored):
    results = pool.run(_loss_case, size, grad_scale, all_ignored)
    values = {}
    for dp_rank, value in results:
        values.setdefault(dp_rank, set()).add(value)
    assert all(len(v) == 1 for v in values.values()), f"ranks of one sequence group disagree: {values}"
    if all_ignored:
        assert all(v == {0.0} for v in values.values()), values
