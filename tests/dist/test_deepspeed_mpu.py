"""deepspeed.initialize(mpu=sp.mpu) with dp=2 x sp=2 on 4 CPU ranks, ZeRO-2."""
import torch

from ds_seqpar import SequenceParallel


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
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                      config=ds_config, mpu=sp.mpu)
    rank = comm.global_rank()
    # each rank's loss has gradient x_rank = (rank + 1) * ones
    x = torch.full((1, 8), float(rank + 1))
    engine.backward(engine(x).sum())
    engine.step()
    reported = {"dp_world_size": engine.dp_world_size, "seq_dp_world_size": engine.seq_dp_world_size,
                "sequence_parallel_size": engine.sequence_parallel_size,
                "seq_data_group_size": comm.group_size(engine.seq_data_parallel_group),
                "dp_ranks": sp.mpu.get_data_parallel_group_ranks(), "sp_rank": sp.rank, "dp_rank": sp.dp_rank}
    return reported, model.weight.detach().clone()


def test_zero2_groups_and_gradients_reduce_over_sequence_x_data(pool):
    results = pool.run(_zero2_engine_groups_and_grad_reduction)
    for rank, (reported, weight) in enumerate(results):
        assert reported["dp_world_size"] == 2 and reported["sequence_parallel_size"] == 2, reported
        assert reported["seq_dp_world_size"] == 4 and reported["seq_data_group_size"] == 4, reported
        assert reported["sp_rank"] == rank % 2 and reported["dp_rank"] == rank // 2, reported
        assert reported["dp_ranks"] == [rank % 2, rank % 2 + 2], reported
        # summed over the 2 sequence ranks, averaged over the 2 replicas: (1+2+3+4)/2 = 5
        torch.testing.assert_close(weight, torch.full((1, 8), -5.0),
                                   msg=lambda m: f"rank {rank}: gradient not reduced over seq x data: {m}")
