"""deepspeed.initialize(mpu=sp.mpu) with dp=2 x sp=2 on 4 CPU ranks: what DeepSpeed sees, and
SequenceParallel(cfg) built without the DeepSpeed config under ZeRO-3 and without ZeRO (SGD, so a
wrong gradient factor shows in the losses, not only in the norms)."""
import pytest
import torch
import torch.nn.functional as F

from ds_seqpar import SequenceParallel

REL, NORM_REL = 1e-5, 1e-4
SEQ, VOCAB, LR, STEPS = 32, 64, 0.5, 3


def _zero2_engine_groups_and_grad_reduction():
    import deepspeed
    from ds_seqpar import comm
    deepspeed.init_distributed(dist_backend="gloo")
    sp = SequenceParallel({"strategy": "ulysses", "size": 2})
    model = torch.nn.Linear(8, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
                 "gradient_clipping": 0.0,
                 "sequence_parallel": {"strategy": "ulysses", "size": 2}}
    before = (sp.mpu.handed_to_deepspeed, sp.loss_grad_scale)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                      config=ds_config, mpu=sp.mpu)
    rank = comm.global_rank()
    # each rank's loss has gradient x_rank = (rank + 1) * ones
    x = torch.full((1, 8), float(rank + 1))
    engine.backward(engine(x).sum())
    engine.step()
    reported = {"dp_world_size": engine.dp_world_size, "seq_dp_world_size": engine.seq_dp_world_size,
                "sequence_parallel_size": engine.sequence_parallel_size,
                "data_group_size": comm.group_size(engine.data_parallel_group),
                "seq_data_group_size": comm.group_size(engine.seq_data_parallel_group),
                "train_batch_size": engine.train_batch_size(), "before": before,
                "after": (sp.mpu.handed_to_deepspeed, sp.loss_grad_scale),
                "sp_rank": sp.rank, "dp_rank": sp.dp_rank}
    return reported, model.weight.detach().clone()


def test_deepspeed_sees_data_parallelism_over_every_rank_and_batches_over_replicas(pool):
    results = pool.run(_zero2_engine_groups_and_grad_reduction)
    for rank, (reported, weight) in enumerate(results):
        # the group is every rank, the size counts replicas (train_batch_size = micro x accum x dp)
        assert reported["dp_world_size"] == 2 and reported["train_batch_size"] == 2, reported
        assert reported["data_group_size"] == 4 and reported["seq_data_group_size"] == 4, reported
        assert reported["seq_dp_world_size"] == 4 and reported["sequence_parallel_size"] == 1, reported
        assert reported["sp_rank"] == rank % 2 and reported["dp_rank"] == rank // 2, reported
        # sp.loss's factor: 1 until DeepSpeed reduces with the mpu, then P
        assert reported["before"] == (False, 1.0) and reported["after"] == (True, 2.0), reported
        # a raw (unscaled) loss is averaged over all 4 ranks: (1+2+3+4)/4 = 2.5
        torch.testing.assert_close(weight, torch.full((1, 8), -2.5),
                                   msg=lambda m: f"rank {rank}: gradient not averaged over every rank: {m}")


# ---------------------------------------------------------------------------------------------
# SequenceParallel(cfg) built directly (no DeepSpeed config) under ZeRO-3


def _tiny_model(sp):
    from ds_seqpar.models import CausalLM, ModelConfig
    torch.manual_seed(0)
    return CausalLM(ModelConfig(vocab_size=VOCAB, dim=16, n_layers=1, n_heads=2, mlp_hidden=32), sp)


def _batch(step, replica):
    g = torch.Generator().manual_seed(100 * step + replica)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _reference(dp_size):
    """Plain data parallelism on one process, SGD: (loss per replica per step, grad norm per step)."""
    model = _tiny_model(None)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [[] for _ in range(dp_size)], []
    for step in range(STEPS):
        opt.zero_grad()
        for d in range(dp_size):
            ids = _batch(step, d)["input_ids"]
            logits = model(ids, torch.arange(SEQ).expand_as(ids))
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
            (loss / dp_size).backward()
            losses[d].append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item())
        opt.step()
    return losses, norms


def _built_under_zero_init(sp):
    """zero.Init over the sequence x data group (the explicit form of what the mpu gives DeepSpeed),
    the seeded plain weights loaded into the partitioned parameters."""
    import deepspeed
    weights = _tiny_model(sp).state_dict()
    with deepspeed.zero.Init(data_parallel_group=sp.groups.seq_data_group,
                             config_dict_or_path={"train_micro_batch_size_per_gpu": 1}):
        model = _tiny_model(sp)
    params = dict(model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0):
        for name, p in params.items():
            p.data.copy_(weights[name])
    return model


def _direct_sp_training(zero, batch_keys, zero_init=False):
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    sp = SequenceParallel({"strategy": "zigzag", "size": 2})          # no DeepSpeed config seen
    model = _built_under_zero_init(sp) if zero_init else _tiny_model(sp)
    ds_config = dict({"zero_optimization": zero, "zero_allow_untested_optimizer": True,
                      "gradient_clipping": 1e6, "steps_per_print": 10**9}, **batch_keys)
    try:
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                          config=ds_config, mpu=sp.mpu)
    except AssertionError as err:
        return {"refused": str(err)}
    losses, norms = [], []
    for step in range(STEPS):
        local = sp.shard_batch(_batch(step, sp.dp_rank))
        loss = sp.loss(engine(local["input_ids"], local["position_ids"]), local["labels"])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norm = engine.get_global_grad_norm()          # None at stage 0: DeepSpeed keeps no norm there
        norms.append(None if norm is None else float(norm))
    weight = model.embed.weight
    partition = weight.ds_numel // max(1, weight.ds_tensor.numel()) if hasattr(weight, "ds_numel") else None
    return {"losses": losses, "norms": norms, "dp_rank": sp.dp_rank, "partition": partition,
            "scale": sp.loss_grad_scale}


MICRO_DP = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 2}


Z3 = {"stage": 3, "stage3_param_persistence_threshold": 0}


@pytest.mark.parametrize("zero,zero_init", [(Z3, False), (dict(Z3, reduce_scatter=False, reduce_bucket_size=300),
                                                         False), (Z3, True), ({"stage": 0}, False)],
                         ids=["zero3", "zero3-buckets-of-both-paths", "zero3-zero.Init-sequence-x-data", "zero0"])
def test_sequence_parallel_built_directly_is_exact_under_zero(pool, zero, zero_init):
    """No from_ds_config; the model built plainly (ZeRO-3: partitioned by deepspeed.initialize
    over every rank) or under zero.Init over the sequence x data group; the loss factor right on
    both of stage 3's reduction paths (a 300-element bucket limit sends the large tensors through
    the one path, the small ones through the other) and without ZeRO (stage 0)."""
    results = pool.run(_direct_sp_training, zero, MICRO_DP, zero_init)
    ref_losses, ref_norms = _reference(2)
    for rank, r in enumerate(results):
        if zero["stage"] == 3:
            assert r["partition"] >= 4, f"rank {rank}: ZeRO-3 partitioned over fewer than the 4 ranks: {r}"
        assert r["scale"] == 2.0, f"rank {rank}: sp.loss factor {r['scale']} under DeepSpeed, want P = 2"
        for step in range(STEPS):
            got, want = r["losses"][step], ref_losses[r["dp_rank"]][step]
            assert abs(got - want) <= REL * abs(want), f"rank {rank} step {step + 1}: loss {got} != plain DP {want}"
            got, want = r["norms"][step], ref_norms[step]
            if got is None and zero["stage"] == 0:
                continue                                # SGD: the losses of steps 2-3 show any factor
            assert abs(got - want) <= NORM_REL * want, f"rank {rank} step {step + 1}: grad norm {got} != {want}"


def test_deepspeed_counts_replicas_in_train_batch_size(pool):
    """DeepSpeed draws the batch line through the mpu: micro x accumulation x REPLICAS. Counting
    every rank (1 x 1 x 4) is refused by DeepSpeed itself, on every rank, before any step."""
    results = pool.run(_direct_sp_training, {"stage": 2}, dict(MICRO_DP, train_batch_size=4))
    assert all("4 != 1 * 1 * 2" in r.get("refused", "") for r in results), results


def _deepspeed_comm_without_its_shm_op():
    import glob
    import os

    import deepspeed
    from deepspeed.comm import comm as ds_comm

    from ds_seqpar import comm
    from ds_seqpar.deepspeed_shm import deepspeed_shm_buffer
    deepspeed.init_distributed(dist_backend="gloo")
    x = torch.full((3,), float(comm.global_rank() + 1), dtype=torch.float32)
    deepspeed.comm.inference_all_reduce(x)          # the one verb that would use the op: the group's sum
    return ds_comm.cdb.shm_comm_op is None, glob.glob(deepspeed_shm_buffer(os.environ)), x.tolist()


def test_deepspeed_comm_starts_without_its_shm_op_and_still_sums(pool):
    # the pool's ranks skip DeepSpeed's CPU shared-memory op (ds_seqpar/deepspeed_shm.py): not built, no
    # /dev/shm file; DeepSpeed's inference all-reduce then takes the process group's path
    for rank, (skipped, buffers, summed) in enumerate(pool.run(_deepspeed_comm_without_its_shm_op)):
        assert skipped and buffers == [], (rank, skipped, buffers)
        assert summed == [10.0] * 3, (rank, summed)
