"""Startup validation: every bad config or input stops every rank, before any communication,
with the same message naming the key (or argument), the bad value and the fix."""
import pytest
import torch

from ds_seqpar import ConfigError, SequenceParallel, SequenceParallelConfig

# (config, needles that must all appear in the message)
BAD_CONFIGS = [
    ({"strategy": "rung", "size": 2}, ["sequence_parallel.strategy='rung'", "choose one of: ulysses, ring"]),
    ({"strategy": "ring", "size": 2, "backend": "cudnn"}, ["sequence_parallel.backend='cudnn'", "auto, flash_attn"]),
    ({"strategy": "ring", "size": 2, "overlapp": True}, ["sequence_parallel.overlapp is not a known key", "overlap"]),
    ({"strategy": "lasp", "size": 2, "lasp_comm": "p2p"}, ["sequence_parallel.lasp_comm='p2p'", "allgather, ring, allscan"]),
    ({"strategy": "ring", "size": 0}, ["sequence_parallel.size=0"]),
    ({"strategy": "ring", "size": 3}, ["sequence_parallel.size=3 does not divide the world size 4", "[1, 2, 4]"]),
    ({"strategy": "ring", "size": 8}, ["sequence_parallel.size=8 does not divide the world size 4",
                                       "launch a multiple of 8 ranks"]),
    ({"strategy": "zigzag", "size": 4, "ulysses_size": 3}, ["ulysses_size=3 must divide", "[1, 2, 4]"]),
    ({"strategy": "lasp", "size": 4, "ulysses_size": 2}, ["ulysses_size=2 combines only with a ring strategy"]),
    ({"strategy": "ulysses", "size": 4, "ulysses_size": 2}, ["ulysses_size=2 with strategy='ulysses' must be 1"]),
    ({"strategy": "ring", "size": 2, "backend": "flash_attn"}, ["backend='flash_attn' needs CUDA", "use backend 'torch'"]),
    ({"strategy": "ring", "size": 2, "timeout_s": -1}, ["sequence_parallel.timeout_s=-1"]),
]


def _construct(cfg):
    try:
        SequenceParallel(cfg)
    except (ConfigError, ValueError) as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("cfg,needles", BAD_CONFIGS, ids=[str(c) for c, _ in BAD_CONFIGS])
def test_bad_config_stops_every_rank_with_one_message(pool, cfg, needles):
    msgs = pool.run(_construct, cfg)
    assert len(set(msgs)) == 1, f"ranks disagree: {msgs}"
    for needle in needles:
        assert needle in msgs[0], f"{needle!r} not in {msgs[0]!r}"


def test_deepspeed_sequence_parallel_size_must_agree():
    ds = {"sequence_parallel_size": 4, "sequence_parallel": {"strategy": "ring", "size": 2}}
    with pytest.raises(ConfigError, match="sequence_parallel_size=4 disagrees with sequence_parallel.size=2"):
        SequenceParallelConfig.from_ds_config(ds)


def _q(*shape, dtype=torch.float32, device="cpu"):
    return torch.zeros(*shape, dtype=dtype, device=device)


# (strategy config, call(sp) -> raises, needles)
BAD_INPUTS = [
    ({"strategy": "ulysses", "size": 4}, lambda sp: sp.attention(_q(1, 8, 6, 16), _q(1, 8, 6, 16), _q(1, 8, 6, 16)),
     ["sequence_parallel.size=4", "6 q heads are not divisible by 4", "ring strategy"]),
    ({"strategy": "ulysses", "size": 2}, lambda sp: sp.attention(_q(1, 8, 4, 16), _q(1, 8, 3, 16), _q(1, 8, 3, 16)),
     ["q heads (4) must be a multiple of k/v heads (3)"]),
    ({"strategy": "zigzag", "size": 4, "ulysses_size": 2},
     lambda sp: sp.attention(_q(1, 8, 3, 16), _q(1, 8, 3, 16), _q(1, 8, 3, 16)),
     ["sequence_parallel.ulysses_size=2", "3 q heads are not divisible by 2"]),
    ({"strategy": "ring", "size": 2}, lambda sp: sp.attention(_q(1, 8, 4, 16), _q(1, 8, 4, 16, dtype=torch.float64),
                                                           _q(1, 8, 4, 16)),
     ["q, k, v must share a dtype", "torch.float32, torch.float64"]),
    ({"strategy": "ring", "size": 2}, lambda sp: sp.attention(_q(1, 8, 4, 16), _q(1, 8, 4, 16, device="meta"),
                                                           _q(1, 8, 4, 16)),
     ["q, k, v must be on one device", "meta"]),
    ({"strategy": "ring", "size": 2}, lambda sp: sp.attention(_q(8, 4, 16), _q(8, 4, 16), _q(8, 4, 16)),
     ["q must be [batch, seq, heads, head_dim]"]),
    ({"strategy": "ring", "size": 2}, lambda sp: sp.attention(_q(1, 8, 4, 16), _q(1, 8, 4, 8), _q(1, 8, 4, 16)),
     ["same head_dim"]),
    ({"strategy": "ring", "size": 2}, lambda sp: sp.attention(_q(1, 8, 4, 16), _q(1, 6, 4, 16), _q(1, 6, 4, 16)),
     ["local sequence length"]),
    ({"strategy": "ulysses", "size": 2}, lambda sp: sp.linear_attention(_q(1, 8, 4, 16), _q(1, 8, 4, 16),
                                                                     _q(1, 8, 4, 16)),
     ["sp.linear_attention needs sequence_parallel.strategy='lasp'"]),
]


def _call(cfg, index):
    sp = SequenceParallel(cfg)
    try:
        BAD_INPUTS[index][1](sp)
    except (ConfigError, ValueError) as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("index", range(len(BAD_INPUTS)), ids=[str(c) for c, _, _ in BAD_INPUTS])
def test_bad_input_stops_every_rank_with_one_message(pool, index):
    cfg, _, needles = BAD_INPUTS[index]
    msgs = pool.run(_call, cfg, index)
    assert len(set(msgs)) == 1, f"ranks disagree: {msgs}"
    for needle in needles:
        assert needle in msgs[0], f"{needle!r} not in {msgs[0]!r}"
