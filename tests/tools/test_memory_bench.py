"""``ds-seqpar bench memory``: the phase model's arithmetic and its rows' goals (no ranks), one measured
step on the session pool (every phase reported, the features leave the loss unchanged), and the
committed report re-derived from the points its rows file carries."""
import json
import os

import pytest

from ds_seqpar.bench import memory_rows as R
from ds_seqpar.bench.memory import MemorySpec, build_parser, measure_peak, points
from ds_seqpar.cost.memory import max_tokens
from ds_seqpar.report.render import result

REPORTS = os.path.join(os.path.dirname(__file__), "..", "..", "reports")
MIB, KIB = 2 ** 20, 1024
PHASES = ("data", "forward", "loss_backward", "layers_backward", "end_of_backward", "optimizer")   # the main job's


def _measurement(model, world, features, n, lines, resident=500 * MIB):
    """A synthetic point whose phases follow ``lines`` = {phase: (a, b)} exactly."""
    phases = {p: a + b * n for p, (a, b) in lines.items()}
    return {"model": model, "world": world, "features": features, "tokens_per_rank": n, "resident_bytes": resident,
            "phase_peak_bytes": phases, "peak_bytes": max(phases.values()), "step_s": [1.0]}


def _rows(measurements=(), timing=None, **meta):
    """The suite's rows of a record of these points: floor = 1 layer x 2048 x 4 B = 8 KiB, budget 1 GiB."""
    meta = dict(dict(layers=1, hidden=2048, heads=16, kv_heads=4, intermediate=5504, vocab=32000,
                     budget_bytes=2 ** 30), **meta)
    return R.rows({"meta": meta, "measurements": list(measurements), "timing": timing or {}})


def _goals(rows):
    """{(case, variant, metric): row} of the rows that name a goal."""
    return {(r.case, r.variant, r.metric): r for r in rows if r.target}


ON = {"forward": (560 * MIB, 10 * KIB), "layers_backward": (540 * MIB, 16 * KIB), "optimizer": (760 * MIB, 0)}
OFF = {"forward": (560 * MIB, 300 * KIB), "loss_backward": (600 * MIB, 500 * KIB), "optimizer": (760 * MIB, 0)}


def test_phase_model_recovers_slopes_and_the_longest_sequence():
    found = _rows(_measurement("lm", 1, True, n, ON) for n in (2048, 4096, 8192))
    v, = [r for r in found if r.metric == R.VARIANTS]
    assert v.detail["phase"] == "layers_backward" and v.value == pytest.approx(16)          # KiB per token
    assert v.detail["x floor"] == pytest.approx(2.0) and v.detail["fit residual MiB"] * MIB < 1e-3
    # the optimizer's fixed peak holds the step's peak at these lengths: no marginal growth yet
    points = [r.detail for r in found if r.metric == R.POINTS]
    assert [d["peak phase"] for d in points] == ["optimizer"] * 3 and points[1]["marginal / token KiB"] == 0
    want = int((2 ** 30 - 540 * MIB) / (16 * KIB))
    assert v.detail["longest tokens/rank"] == want and v.detail["longest sequence"] == want
    assert max_tokens({"optimizer": {"a": 2.0 ** 31, "b": 0.0}}, 2 ** 30) == 0


def test_checks_compare_features_floor_and_ranks():
    ms = [_measurement("lm", p, f, n, ON if f else OFF, resident=(500 if p == 1 else 450) * MIB)
          for p in (1, 2) for f in (True, False) for n in (1024, 4096)]
    found = _rows(ms)
    assert {r.variant for r in found if r.metric == R.VARIANTS} == {"P=1 on", "P=1 off", "P=2 on", "P=2 off"}
    results = _goals(found)
    ratio = results["lm", "P=1", R.FEATURES]
    assert ratio.value == pytest.approx(16 / 500) and result(ratio) == "PASS"
    assert result(results["lm", "P=1", R.FLOOR]) == "PASS"
    longest = results["lm", "with features", R.LONGEST]
    assert longest.value == pytest.approx(2.0, rel=1e-3) and result(longest) == "PASS"
    fat = {"layers_backward": (540 * MIB, 40 * KIB), "optimizer": (760 * MIB, 0)}
    bad = _rows([_measurement("lm", 1, True, n, fat) for n in (1024, 4096)])
    assert [result(r) for r in _goals(bad).values()] == ["SHORT"], "40 KiB per token is 5x the floor"


def test_implied_step_time_ratio_counts_the_recompute():
    # multiply-accumulates per token: head 4x10 = 40, projections 4 x (8 + 4) = 48, attention hidden x P x N,
    # MLP 3 x 4 x 8 = 96; plain: 3 x forward; with the features the head 4x, the mixers 4x, the MLP 5x
    meta = dict(hidden=4, heads=2, kv_heads=1, vocab=10, intermediate=8, layers=1)

    def timing_rows(timing, **change):
        return [r for r in _rows(timing=timing, **dict(meta, **change)) if r.metric == R.TIMING]

    once = {"lm/P1": {"tokens_per_rank": 2, "off_s": [1.0], "on_s": [1.0]}}
    assert timing_rows(once)[0].predicted == pytest.approx((4 * 40 + 4 * (48 + 8) + 5 * 96) / (3 * (40 + 48 + 8 + 96)))
    assert timing_rows(once, layers=0)[0].predicted == pytest.approx(4 / 3)        # the fused loss alone
    timing = {"lm/P2": {"tokens_per_rank": 2, "off_s": [1.0, 1.0, 1.2], "on_s": [1.5, 1.8, 1.5]}}
    row, = timing_rows(timing)
    assert row.value == pytest.approx(1.5) and row.predicted == pytest.approx(896 / 600)   # attention over P x N = 4 tokens
    assert [result(r) for r in _goals([row]).values()] == ["PASS"]
    slow = dict(timing["lm/P2"], on_s=[1.8, 1.8, 2.16])                                    # 1.8 every round
    assert [result(r) for r in _goals(timing_rows({"lm/P2": slow})).values()] == ["SHORT"]


def test_points_follow_the_preset_and_reject_unknown_models():
    specs = points(build_parser().parse_args(["--models", "lm", "--P", "1,4", "--strategies", ""]))
    assert [(s.world, s.features, s.tokens_per_rank) for s in specs] == [
        (1, False, 1024), (1, False, 2048), (1, True, 2048), (1, True, 8192), (1, True, 16384),
        (4, False, 1024), (4, False, 2048), (4, True, 2048), (4, True, 4096)]
    with pytest.raises(ValueError, match="unknown model 'gpt'"):
        points(build_parser().parse_args(["--models", "gpt"]))
    with pytest.raises(ValueError, match=r"--strategies: unknown \['lasp'\]"):
        points(build_parser().parse_args(["--strategies", "zigzag,lasp"]))


def test_strategy_comparison_plans_every_strategy_at_the_same_tokens_per_rank():
    specs = [s for s in points(build_parser().parse_args(["--models", "lm", "--strategies", "ring,hybrid",
                                                        "--compare-tokens", "4096"])) if s.purpose == "strategies"]
    assert [(s.world, s.strategy, s.ulysses_size, s.tokens_per_rank) for s in specs] == [
        (1, "zigzag", 1, 4096), (2, "ring", 1, 4096), (4, "ring", 1, 4096), (4, "zigzag", 2, 4096),
        (1, "zigzag", 1, 256), (2, "zigzag", 1, 256)]
    default = [(s.world, s.tokens_per_rank) for s in points(build_parser().parse_args(["--strategies", "ulysses"]))
               if s.purpose == "strategies"]
    assert default == [(1, 8192), (1, 4096), (2, 8192), (4, 4096), (1, 256), (2, 256)]
    # the shipped long-context recipe's memory features
    with open(os.path.join(REPORTS, "..", "configs", "long_context.json")) as f:
        shipped = json.load(f)["sequence_parallel"]
    assert all((s.tiled_loss_tokens, s.tiled_mlp_tokens) == (shipped["tiled_loss_tokens"], shipped["tiled_mlp_tokens"])
               and s.features and s.model == "llama" for s in specs)


def _compared(world, strategy, n, above, phases=None):
    m = _measurement("llama", world, True, n, {"optimizer": (700 * MIB, 0)}, resident=500 * MIB)
    above_phases = phases or {"forward": above, "optimizer": 200 * MIB}
    return dict(m, strategy=strategy, purpose="strategies", above_static_bytes=max(above_phases.values()),
                phase_above_static_bytes=above_phases, peak_bytes=500 * MIB + max(above_phases.values()),
                phase_peak_bytes={p: 500 * MIB + v for p, v in above_phases.items()})


def test_strategy_rows_compare_above_static_and_explain_the_two_point_figure():
    n = 8192
    ms = [_compared(1, "zigzag", n, 300 * MIB), _compared(2, "zigzag", n, 310 * MIB),
          _compared(4, "ring", n, 360 * MIB), _compared(1, "zigzag", 4096, 200 * MIB),
          _compared(4, "ulysses", 4096, 210 * MIB), dict(_compared(4, "zigzag", 4096, 200 * MIB), ulysses_size=2),
          # short runs: the optimizer step (200 MiB above static) holds the peak
          _compared(1, "zigzag", 256, 20 * MIB), _compared(2, "zigzag", 256, 20 * MIB)]
    found = _rows(ms)
    comp = [r for r in found if r.metric == R.STRATEGIES]
    assert [(r.case, r.variant) for r in comp] == [
        ("(none: P=1)", f"P=1, {n} tokens/rank"), ("(none: P=1)", "P=1, 4096 tokens/rank"),
        ("zigzag", f"P=2, {n} tokens/rank"), ("ring", f"P=4, {n} tokens/rank"), ("ulysses", "P=4, 4096 tokens/rank"),
        ("hybrid (zigzag x Ulysses 2)", "P=4, 4096 tokens/rank")]
    assert [round(r.value, 4) for r in comp] == [1.0, 1.0, round(310 / 300, 4), 1.2, 1.05, 1.0]
    assert comp[2].detail["peak phase"] == "forward"
    checks = {f"{case} {variant}": result(r) for (case, variant, _), r in _goals(found).items()}
    assert checks == {f"zigzag P=2, {n} tokens/rank": "PASS", f"ring P=4, {n} tokens/rank": "SHORT",   # 1.20 > 1.15
                      "ulysses P=4, 4096 tokens/rank": "PASS", "hybrid (zigzag x Ulysses 2) P=4, 4096 tokens/rank": "PASS"}
    (one, two) = [r for r in found if r.metric == R.TWO_POINT]
    assert one.detail["its phase"] == "optimizer" and one.value * KIB == pytest.approx(100 * MIB / (n - 256))
    assert one.detail["above static / token KiB"] * KIB == pytest.approx(300 * MIB / n)


TINY = dict(model="lm", world=2, tokens_per_rank=256, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64,
            tiled_loss_tokens=64, tiled_mlp_tokens=64)


def _both(spec_args):
    return measure_peak(MemorySpec(features=False, **spec_args)), measure_peak(MemorySpec(features=True, **spec_args))


def test_measured_step_reports_every_phase_and_features_keep_the_loss(pool):
    for off, on in pool.run(_both, TINY):
        for r in (off, on):
            assert set(r["phase_peak_bytes"]) == set(PHASES), r["phase_peak_bytes"]
            assert r["peak_bytes"] == max(r["phase_peak_bytes"].values()) >= r["resident_bytes"] > 0
        assert on["losses"][0] == pytest.approx(off["losses"][0], rel=1e-5), (on["losses"], off["losses"])


def test_committed_report_renders_from_its_json(tmp_path):
    path = os.path.join(REPORTS, "memory_cpu.rows.json")
    if not os.path.exists(path):
        pytest.skip("reports/memory_cpu.rows.json not generated yet")
    from ds_seqpar.bench.memory_rows import facts, rows
    from ds_seqpar.report.render import render
    from ds_seqpar.report.rows import load_rows
    res = load_rows(path)[1]                        # the run's record rides in the rows file's facts
    with open(os.path.join(REPORTS, "memory_cpu.md")) as f:
        committed = f.read()
    assert render(rows(res), facts(res)) == committed, "reports/memory_cpu.md differs from its JSON's rendering"


def test_resume_measures_only_the_points_its_rows_file_lacks(tmp_path, monkeypatch):
    """--resume on the committed rows file with the flags of its last command: every point is there,
    so no rank starts and the page is rewritten; one more length asks for that one point alone."""
    import shutil
    from ds_seqpar.bench import memory as M
    from ds_seqpar.report.rows import load_rows
    shutil.copy(os.path.join(REPORTS, "memory_cpu.rows.json"), tmp_path)
    asked = []

    class Stopped(Exception):
        """A run stopped while measuring."""

    def measure_one(spec, malloc):
        asked.append(spec)
        raise Stopped

    monkeypatch.setattr(M, "measure_one", measure_one)
    monkeypatch.setattr(R, "write_plots", lambda res, out: None)     # the page's figures: not what is tested
    flags = ["--models", "llama", "--P", "4", "--off-tokens", "1024,2048", "--timing-tokens", "0", "--strategies", "",
             "--resume", "--out", str(tmp_path)]
    assert M.main(flags + ["--on-tokens", "2048,4096,8192"]) == 0 and asked == []
    assert len(load_rows(str(tmp_path / "memory_cpu.rows.json"))[1]["measurements"]) == 29
    assert os.path.exists(tmp_path / "memory_cpu.md")
    with pytest.raises(Stopped):
        M.main(flags + ["--on-tokens", "2048,4096,8192,16384"])
    assert [(s.world, s.features, s.tokens_per_rank) for s in asked] == [(4, True, 16384)]
