"""`ds-seqpar report`'s labels name what differs between runs (the model when it differs, the run's
name where two runs share a setup) and its page warns about runs stepped on a loaded machine."""
from ds_seqpar.report.main import _labels, _load_warning, loaded


def _run(name, model="lm-l2-d32", strategy="zigzag", loads=(0.5, 0.7), cpus=2):
    config = {"name": name, "model_name": model, "strategy": strategy, "sp_size": 2, "dp_size": 2, "seq_len": 64,
              "machine": {"host": "h", "cpus": cpus, "load_1min_start": loads[0]}}
    return {"path": f"runs/{name}", "config": config, "steps": [{"step": i + 1, "load_1min": x} for i, x in enumerate(loads)]}


def test_labels_name_the_model_when_runs_differ_in_it_and_the_run_where_setups_collide():
    assert _labels([_run("a"), _run("b", strategy="ulysses")]) == ["zigzag sp2xdp2 n64", "ulysses sp2xdp2 n64"]
    assert _labels([_run("a"), _run("b", model="qwen3_5_small")]) == ["lm-l2-d32 zigzag sp2xdp2 n64",
                                                                      "qwen3_5_small zigzag sp2xdp2 n64"]
    assert _labels([_run("seed0"), _run("seed1")]) == ["zigzag sp2xdp2 n64 (seed0)", "zigzag sp2xdp2 n64 (seed1)"]


def test_a_run_stepped_above_one_load_per_core_is_warned_about_and_a_quiet_one_is_not():
    quiet, busy = _run("quiet"), _run("busy", loads=(1.0, 5.0))
    assert loaded(quiet) is None and loaded(busy) == 2.5
    assert _load_warning([quiet]) == ""
    warning = _load_warning([quiet, busy])
    assert "busy (2.5 per core)" in warning and "quiet (" not in warning
    assert loaded({"path": "old", "config": {}, "steps": [{"step": 1}]}) is None     # recorded before loads were
