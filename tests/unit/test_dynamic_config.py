"""size: "dynamic" + max_tokens_per_rank in the sequence_parallel key: accepted forms and every bad
input with a message naming the key, the value and what works."""
import pytest

from ds_seqpar import SequenceParallelConfig
from ds_seqpar.config import ConfigError


def test_dynamic_size_with_a_token_budget_is_accepted_for_every_strategy():
    for strategy in ("ulysses", "ring", "zigzag", "striped", "lasp"):
        cfg = SequenceParallelConfig.parse({"strategy": strategy, "size": "dynamic", "max_tokens_per_rank": 512})
        assert cfg.is_dynamic and cfg.max_tokens_per_rank == 512, cfg
    hybrid = SequenceParallelConfig.parse({"strategy": "zigzag", "size": "dynamic", "max_tokens_per_rank": 64,
                                           "ulysses_size": 2})
    assert hybrid.is_dynamic and hybrid.ulysses_size == 2
    static = SequenceParallelConfig.parse({"size": 2})
    assert not static.is_dynamic and static.max_tokens_per_rank is None


@pytest.mark.parametrize("section, words", [
    ({"size": "dynamic"}, ["sequence_parallel.size='dynamic' needs sequence_parallel.max_tokens_per_rank",
                           "missing"]),
    ({"size": 2, "max_tokens_per_rank": 64}, ["max_tokens_per_rank=64 goes with size='dynamic' only"]),
    ({"size": "dynamic", "max_tokens_per_rank": 0}, ["sequence_parallel.max_tokens_per_rank=0", "greater than or equal to 1"]),
    ({"size": "dynamic", "max_tokens_per_rank": "lots"}, ["sequence_parallel.max_tokens_per_rank='lots'"]),
    ({"size": "dyn"}, ["sequence_parallel.size='dyn' is not valid", "an integer >= 1 or 'dynamic'"]),
    ({"size": "dynamic", "max_tokens_per_rank": 64, "strategy": "lasp", "ulysses_size": 2},
     ["ulysses_size=2 with size='dynamic' is the 2D hybrid", "ring, zigzag, striped",
      "strategy='lasp' needs ulysses_size=1"]),
    ({"size": "dynamic", "max_tokens_per_rank": 64, "strategy": "rings"}, ["strategy='rings' is not valid"]),
])
def test_bad_dynamic_settings_name_key_value_and_what_works(section, words):
    with pytest.raises(ConfigError) as err:
        SequenceParallelConfig.parse(section)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_static_entry_points_refuse_a_dynamic_config_with_a_pointer():
    cfg = SequenceParallelConfig.parse({"size": "dynamic", "max_tokens_per_rank": 64})
    with pytest.raises(ConfigError, match="DynamicSequenceParallel"):
        cfg.check_world(4)
    # DeepSpeed's sequence_parallel_size is not compared with a dynamic size
    ds = {"sequence_parallel": {"size": "dynamic", "max_tokens_per_rank": 64}, "sequence_parallel_size": 1}
    assert SequenceParallelConfig.from_ds_config(ds).is_dynamic


def test_the_hf_trainer_refuses_dynamic_groups_at_construction_with_what_works():
    from types import SimpleNamespace
    from ds_seqpar.hf.trainer import _sequence_parallel
    ds = {"sequence_parallel": {"strategy": "zigzag", "size": "dynamic", "max_tokens_per_rank": 64}}
    targs = SimpleNamespace(deepspeed="ds.json", hf_deepspeed_config=SimpleNamespace(config=ds))
    with pytest.raises(ConfigError, match="does not run sequence_parallel.size='dynamic' yet; use an integer size") \
            as err:
        _sequence_parallel(targs)
    assert "--model PATH --lengths FILE --sp_size dynamic" in str(err.value) \
        and "apply_sequence_parallel(model, DynamicSequenceParallel" in str(err.value), str(err.value)


def test_a_fixed_head_chunk_count_must_fit_every_dynamic_group_size():
    from ds_seqpar.dynamic import check_dynamic_chunks
    cfg = SequenceParallelConfig.parse({"strategy": "ulysses", "size": "dynamic", "max_tokens_per_rank": 64,
                                        "ulysses_chunks": 2})
    check_dynamic_chunks(cfg, [1, 2], 8, 8)                   # 4 k/v heads a rank at size 2
    with pytest.raises(ConfigError) as err:
        check_dynamic_chunks(cfg, [1, 2, 4, 8], 8, 8)         # size 8: one k/v head a rank
    assert "ulysses_chunks=2" in str(err.value) and "group size 8" in str(err.value), err.value
    auto = SequenceParallelConfig.parse(dict(cfg.model_dump(), ulysses_chunks="auto"))
    check_dynamic_chunks(auto, [1, 2, 4, 8], 8, 8)
