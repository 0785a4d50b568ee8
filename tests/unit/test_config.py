"""The sequence_parallel config key: schema, validation messages, DeepSpeed agreement."""
import json

import pytest

from ds_seqpar import ConfigError, SequenceParallelConfig


def test_defaults_and_fields():
    cfg = SequenceParallelConfig(strategy="striped", size=4)
    assert (cfg.strategy, cfg.size, cfg.ulysses_size, cfg.backend, cfg.lasp_comm, cfg.overlap) == \
        ("striped", 4, 1, "auto", "allgather", True)
    assert cfg.ring_size == 4 and not cfg.is_hybrid
    assert cfg.ulysses_chunks == "auto" and SequenceParallelConfig(ulysses_chunks=4).ulysses_chunks == 4


def test_hybrid_key_and_sizes():
    cfg = SequenceParallelConfig(strategy="zigzag", size=4, ulysses_size=2)
    assert cfg.is_hybrid and cfg.ring_size == 2 and cfg.effective_ulysses_size == 2


@pytest.mark.parametrize("section,needles", [
    ({"strategy": "rung"}, ["sequence_parallel.strategy='rung'", "ulysses, ring, zigzag, striped, lasp"]),
    ({"backend": "cudnn"}, ["sequence_parallel.backend='cudnn'", "auto, flash_attn, torch, math"]),
    ({"lasp_comm": "p2p"}, ["sequence_parallel.lasp_comm='p2p'", "allgather, ring"]),
    ({"sizee": 2}, ["sequence_parallel.sizee is not a known key", "known keys: strategy, size"]),
    ({"size": 0}, ["sequence_parallel.size=0"]),
    ({"strategy": "ring", "size": 4, "ulysses_size": 3}, ["ulysses_size=3 must divide", "size=4", "[1, 2, 4]"]),
    ({"strategy": "lasp", "size": 4, "ulysses_size": 2}, ["ulysses_size=2 combines only with a ring strategy"]),
    ({"ulysses_chunks": 0}, ["sequence_parallel.ulysses_chunks=0", "'auto' or an integer >= 1"]),
    ({"ulysses_chunks": "two"}, ["sequence_parallel.ulysses_chunks='two'", "'auto' or an integer >= 1"]),
    ({"ulysses_chunks": True}, ["sequence_parallel.ulysses_chunks=True"]),
    ({"ulysses_chunks": 2, "overlap": False}, ["ulysses_chunks=2", "overlap=false", "ulysses_chunks 1"]),
])
def test_bad_values_name_key_value_and_choices(section, needles):
    with pytest.raises(ConfigError) as err:
        SequenceParallelConfig.parse(section)
    for needle in needles:
        assert needle in str(err.value), f"{needle!r} not in {err.value}"


def test_size_must_divide_world():
    cfg = SequenceParallelConfig(strategy="ring", size=3)
    with pytest.raises(ConfigError, match=r"size=3 does not divide the world size 4; valid sizes for this world: \[1, 2, 4\]"):
        cfg.check_world(4)
    cfg.check_world(6)


def test_from_ds_config_dict_file_and_agreement(tmp_path):
    ds = {"train_batch_size": 8, "sequence_parallel": {"strategy": "zigzag", "size": 2}}
    assert SequenceParallelConfig.from_ds_config(ds).strategy == "zigzag"
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    assert SequenceParallelConfig.from_ds_config(str(path)).size == 2
    with pytest.raises(ConfigError, match="sequence_parallel_size=4 disagrees with sequence_parallel.size=2"):
        SequenceParallelConfig.from_ds_config({**ds, "sequence_parallel_size": 4})
    assert SequenceParallelConfig.from_ds_config({**ds, "sequence_parallel_size": 2}).size == 2
    assert SequenceParallelConfig.from_ds_config({"train_batch_size": 8}).size == 1


def test_missing_file_is_clear():
    with pytest.raises(ConfigError, match="does not exist"):
        SequenceParallelConfig.from_ds_config("/nonexistent/ds.json")


def test_comm_dtype_follows_deepspeeds_key_and_must_agree_with_it():
    assert SequenceParallelConfig.from_ds_config({"sequence_parallel": {"size": 2}}).comm_dtype == "auto"
    ds = {"sequence_parallel": {"size": 2}, "seq_parallel_communication_data_type": "bf16"}
    assert SequenceParallelConfig.from_ds_config(ds).comm_dtype == "bf16"
    ds["sequence_parallel"]["comm_dtype"] = "fp32"
    with pytest.raises(ConfigError, match="seq_parallel_communication_data_type='bf16' disagrees with "
                                          "sequence_parallel.comm_dtype='fp32'"):
        SequenceParallelConfig.from_ds_config(ds)
    with pytest.raises(ConfigError, match="comm_dtype='int8' is not valid; choose one of: auto, fp32, bf16, fp16"):
        SequenceParallelConfig.parse({"comm_dtype": "int8"})


@pytest.mark.parametrize("section, heads, needles", [
    ({"strategy": "ulysses", "size": 4}, (6, 6), ["sequence_parallel.size=4", "6 q heads are not divisible by 4"]),
    ({"strategy": "ulysses", "size": 2}, (4, 3), ["q heads (4) must be a multiple of k/v heads (3)"]),
    ({"strategy": "zigzag", "size": 4, "ulysses_size": 2}, (3, 3),
     ["sequence_parallel.ulysses_size=2", "3 q heads are not divisible by 2"]),
    ({"strategy": "ring", "size": 4}, (3, 1), None),          # the ring splits the sequence, not heads
    ({"strategy": "ulysses", "size": 2}, (8, 2), None),
    # head chunks hold whole k/v groups of a rank's heads: 8 q / 4 kv over 2 ranks = 2 kv heads a rank
    ({"strategy": "ulysses", "size": 2, "ulysses_chunks": 2}, (8, 4), None),
    ({"strategy": "ulysses", "size": 2, "ulysses_chunks": 4}, (8, 4),
     ["sequence_parallel.ulysses_chunks=4", "valid: 1, 2 or 'auto'"]),
    # 12 q / 6 kv over 4 ranks: each k/v head repeated twice, 3 a rank
    ({"strategy": "ulysses", "size": 4, "ulysses_chunks": 2}, (12, 6), ["ulysses_chunks=2", "valid: 1, 3 or 'auto'"]),
    ({"strategy": "zigzag", "size": 4, "ulysses_size": 2, "ulysses_chunks": 3}, (8, 8),
     ["ulysses_chunks=3", "valid: 1, 2, 4 or 'auto'"]),
    ({"strategy": "ring", "size": 4, "ulysses_chunks": 3}, (8, 8), None),    # no all-to-all: nothing to chunk
    ({"strategy": "ulysses", "size": 4, "ulysses_chunks": 8, "overlap": True}, (32, 32), None),
])
def test_head_check_needs_only_the_config(section, heads, needles):
    """The job runs this before joining the world (train/main.check_run), with no process group;
    sp.attention runs the same function on every call (tests/dist/test_validation.py)."""
    from ds_seqpar import strategies
    cfg = SequenceParallelConfig.parse(section)
    if needles is None:
        strategies.check_heads(cfg, *heads)
        return
    with pytest.raises(ValueError) as err:
        strategies.check_heads(cfg, *heads)
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_the_config_names_are_the_registries():
    # config.py spells them so that it imports no torch (the main job checks a config before torch loads)
    from ds_seqpar import config, kernels, strategies
    assert config.STRATEGY_NAMES == tuple(strategies.STRATEGIES)
    assert config.RING_STRATEGIES == strategies.RING_STRATEGIES
    assert config.BACKENDS == kernels.BACKENDS
    from ds_seqpar.strategies.lasp_comm import EXCHANGES
    assert config.LASP_COMMS == tuple(EXCHANGES)


def test_a_near_miss_gets_the_nearest_name():
    with pytest.raises(ConfigError, match=r"strategy='stripe' is not valid \(did you mean 'striped'\?\); choose"):
        SequenceParallelConfig.parse({"strategy": "stripe"})
    with pytest.raises(ConfigError, match=r"backend='flash-attn' is not valid \(did you mean 'flash_attn'\?\)"):
        SequenceParallelConfig.parse({"backend": "flash-attn"})
    with pytest.raises(ConfigError) as err:
        SequenceParallelConfig.parse({"strategy": "pipeline"})
    assert "did you mean" not in str(err.value)
