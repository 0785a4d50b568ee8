"""--calibrate (plan/measure.py, plan/calibrate.py, plan/calibrate_report.py): its fits, and its predictions
of what the bench measured here, read from the bench's rows (reports/cpu_full, hybrid_cpu, window_cpu,
memory_cpu .rows.json) with the calibration reports/plan_cpu.rows.json keeps. No timing and no ranks
here: the fits are fed made-up points or the saved calibration."""
from __future__ import annotations

import os

import pytest

from ds_seqpar.kernels.bands import SubBlock, visible_pairs
from ds_seqpar.plan import calibrate as cb, calibrate_report as cr
from ds_seqpar.cost import pairs, times
from ds_seqpar.plan.hardware import load_gpu
from ds_seqpar.plan.measure import fit_call_cost
from ds_seqpar.report.rows import load_rows

REPORTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "reports")


def _run(name):
    return cb.Run(os.path.join(REPORTS, f"{name}.rows.json"))


@pytest.fixture(scope="module")
def runs():
    return {name: _run(name) for name in ("cpu_full", "hybrid_cpu", "window_cpu", "memory_cpu")}


@pytest.fixture(scope="module")
def saved():
    """The committed page: its rows by metric and the calibration it was computed with."""
    rows, facts = load_rows(os.path.join(REPORTS, "plan_cpu.rows.json"))
    by = {}
    for r in rows:
        by.setdefault(r.metric, []).append(r)
    return by, facts["calibration"]


@pytest.fixture(scope="module")
def fit(runs):
    """The exchange fit over cpu_full's softmax rows with no per-call cost (an untrusted block fit)."""
    return cb.softmax_fit(runs["cpu_full"], {})


@pytest.fixture(scope="module")
def calibrated(runs, saved):
    """The exchange fit with the saved calibration's per-call cost, as the page computed it."""
    return cb.softmax_fit(runs["cpu_full"], saved[1]["blocks"])


@pytest.fixture(scope="module")
def window_rows(runs, calibrated, saved):
    """Computed once: the plan's window pieces and bytes at N=8192 take a second or two."""
    return cb.window_rows(runs["window_cpu"], calibrated[1], saved[1]["blocks"])


def test_computed_pairs_count_the_diagonal_tiles():
    t = pairs.KEY_TILE
    assert pairs.computed_pairs(300, 200, False) == 60000
    assert pairs.computed_pairs(4096, 4096, True) == 4096 * 4097 / 2 + 4096 * t / 2
    # the CPU kernel's measured cost per visible pair over a full block's (kernels/torch_kernel.py's note:
    # 2.1x at 512, 1.5x at 1024, 1.13x at 4096) is computed / visible
    for s, ratio in ((512, 2.1), (1024, 1.5), (4096, 1.13)):
        assert pairs.computed_pairs(s, s, True) / (s * (s + 1) / 2) == pytest.approx(ratio, rel=0.06)
    assert pairs.computed_pairs(64, 64, True) <= 64 * 64               # never more than the block


def test_call_cost_fit_recovers_its_line():
    pts = [(p, 3e-4 + 2e-8 * p) for p in (1e5, 5e5, 2e6, 8e6, 2e7)]
    fit = fit_call_cost(pts)
    assert fit["c_call_s"] == pytest.approx(3e-4, rel=1e-6) and fit["t_pair_s"] == pytest.approx(2e-8, rel=1e-6)


def test_striped_is_busier_than_zigzag_by_its_diagonal_tiles():
    """At P=2 striped's rank runs two causal squares, zigzag's one square and one rectangle: the tile
    model puts striped 5-6% behind at N=8192, as cpu_full measured (1.69 vs 1.80)."""
    cost = {"c_call_s": 0.0, "t_pair_s": 1.0}
    z, s = (times.busiest_kernel_s(x, 2, 8192, 8, cost) for x in ("zigzag", "striped"))
    assert 1.04 < s / z < 1.08
    assert [len(c) for c in times.rank_calls("ring", 2, 1024)] == [1, 2]


def test_softmax_speedups_within_15_percent_out_of_sample(fit):
    """Each length predicted with (alpha, beta) fitted on the other lengths: at least 15 of cpu_full's
    16 rows within 15% (the miss allowed: Ulysses at N=1024, whose 8 all-to-alls cost more than the
    fit's per-message latency), every N=8192 row within 8%."""
    off = {(int(r.variant[2:]), r.case): r.predicted / r.value for r in fit[0]}
    assert len(off) == 16
    bad = {k: v for k, v in off.items() if abs(v - 1) > 0.15}
    assert set(bad) <= {(1024, "ulysses")}, bad
    assert all(abs(v - 1) <= 0.08 for (n, _), v in off.items() if n == 8192), off


def test_lasp_and_hybrid_rows_use_the_softmax_fit_within_15_percent(runs, fit):
    lasp = cb.lasp_rows(runs["cpu_full"], fit[1])
    assert len(lasp) == 8 and all(abs(r.predicted / r.value - 1) <= 0.15 for r in lasp), lasp
    hybrid = cb.hybrid_rows(runs["hybrid_cpu"], fit[1])
    assert len(hybrid) == 9 and all(abs(r.predicted / r.value - 1) <= 0.15 for r in hybrid), hybrid


def test_exchange_fit_recovers_alpha_beta():
    rows = [{"messages": m, "bytes": b, "kernel_s": 1.0, "measured_s": 1.0 + 2e-4 * m + b / 5e8}
            for m, b in ((8, 4e6), (3, 6e6), (8, 3e7), (3, 5e7))]
    fit = cb.fit_exchange(rows)
    assert fit["alpha_s"] == pytest.approx(2e-4, rel=1e-6) and fit["beta_bytes_s"] == pytest.approx(5e8, rel=1e-6)


def test_training_step_speedups_within_15_percent(runs, fit):
    """cpu_full's P=2 training steps (zigzag, ulysses, lasp): the measured P=1 step x the plan's compute
    ratio + the step's exchanges at the softmax fit, within 15% of the measured speedups."""
    rows = cb.step_rows(runs["cpu_full"], fit[1], load_gpu("h100"))[0]
    assert {r.case for r in rows} == {c for c, _ in runs["cpu_full"].table("Whole training step")}
    assert all(abs(r.predicted / r.value - 1) <= 0.15 for r in rows), rows


def test_calibrate_on_rows_gives_the_numbers_of_before(runs, saved, calibrated, window_rows):
    """The calibration saved with the page, applied to the bench's rows, gives every number of the
    committed page, and those are the numbers --calibrate computed from the bench's JSON before it read
    rows (reports/plan_cpu.json then: the exchange fit and one prediction per table, bit for bit)."""
    by, cal = saved
    full, profile = runs["cpu_full"], cr.cpu_profile(cal["comm"], cal["kernels"])
    soft, fit = calibrated
    assert (fit["alpha_s"], fit["beta_bytes_s"]) == (0.0002840600776062204, 498401640.20002186)
    steps = cb.step_rows(full, fit, profile)
    ours = {cb.SOFTMAX_FIT: soft, cb.LASP: cb.lasp_rows(full, fit), cb.HYBRID: cb.hybrid_rows(runs["hybrid_cpu"], fit),
            cb.STEP_FIT: steps[0], cb.STEP_PLAN: steps[1], cb.FIRST: cb.first_model_rows(cal, full),
            cb.WINDOW: window_rows[0], cb.MEMORY: cb.memory_rows(runs["memory_cpu"])}
    for metric, rows in ours.items():
        assert [(r.case, r.variant, r.value, r.predicted) for r in rows] == \
            [(r.case, r.variant, r.value, r.predicted) for r in by[metric]], metric
    before = {cb.SOFTMAX_FIT: ("zigzag", "N=8192", 1.8230167804069457), cb.WINDOW: ("ring", "w=1024", 0.19843208540944043),
              cb.HYBRID: ("gdn", "lasp_allgather", 1.9329053508441063), cb.LASP: ("lasp1", "N=8192", 1.9168232063636057),
              cb.STEP_FIT: ("zigzag", "seq 4096", 1.7526743080127767), cb.STEP_PLAN: ("ulysses", "seq 4096", 1.8981913828577908)}
    for metric, (case, variant, predicted) in before.items():
        assert [r.predicted for r in ours[metric] if (r.case, r.variant) == (case, variant)] == [predicted], metric
    assert [(r.value, r.predicted) for r in cb.phase_rows(runs["memory_cpu"])] == \
        [(r.value, r.predicted) for r in by[cb.P4_MEMORY]]


def test_window_calls_are_the_sub_blocks_the_benchmark_ran(runs):
    """window_cpu's kernel table counted the busiest rank's sub-blocks and their visible pairs per strategy
    and window (the masked plan cut by the CPU kernel's tiles and key columns): the plan's calls must be
    the same, call for call."""
    window = runs["window_cpu"]
    p, n = window.meta["P"], window.meta["seq"]
    pieces = {k: r for k, r in window.table("Kernel calls alone").items() if not k[1].startswith("-")}
    assert len(pieces) == 8
    for (strategy, variant), r in pieces.items():
        w, rank = (int(x) for x in variant.split(", rank "))
        calls = times.rank_calls(strategy, p, n, True, w)[rank]
        pairs_ = sum(visible_pairs(SubBlock(slice(0, nq), slice(0, nk), c, a)) for nq, nk, c, a in calls)
        assert (len(calls), pairs_) == (r.detail["sub-blocks"], r.detail["visible pairs"]), f"{strategy} w={w}"
        assert any(c and nq > nk for nq, nk, c, _ in calls), "no tall key-column block: the window is cut by rows"


def test_window_time_ratios_within_15_percent(window_rows):
    """Every (strategy, window) of window_cpu: the time ratio window / plain predicted from the policy's
    sub-blocks within 15% of the measured one (ring and zigzag come out a few percent low: the merges
    after each sub-block are not priced)."""
    rows = window_rows[0]
    assert len(rows) == 8
    off = {(r.case, r.variant): round(r.predicted / r.value, 3) for r in rows}
    assert all(abs(v - 1) <= 0.15 for v in off.values()), off
    # the priced kernel calls against window_cpu's timing of the same calls alone (no loop around them)
    alone = {(r.case, r.variant): round(r.detail["kernel s priced"] / r.detail["kernel s timed alone"], 3) for r in rows}
    assert all(abs(v - 1) <= 0.10 for v in alone.values()), alone


def test_window_bytes_are_the_closed_form_and_the_measured(window_rows):
    for r in window_rows[1]:
        assert r.predicted == r.detail["closed form"] == r.value, (r.case, r.variant)


def test_p4_bytes_per_rank_are_the_closed_form():
    """Every softmax strategy and the 2D hybrid at P=4, plain and windowed, rank by rank (a shorter
    sequence than the report's 8192 keeps the closed form's span search fast)."""
    rows = cb.p4_bytes_rows(seq=4096, windows=(512, 1024))
    assert len(rows) == 3 * len(cb.P4_LAYOUTS)
    for r in rows:
        assert len(r.value) == 4 and r.value == r.predicted, r
    ring = {r.variant.split("window=")[1]: r.value for r in rows if r.case == "ring"}
    assert max(ring["512"]) < max(ring["-"]) / 4        # the window really cut the ring's bytes


def test_p4_memory_per_token_against_the_measured_step(runs):
    """memory_cpu's P=4 scaling rows: the plain step within 5% in every phase; with the features the
    step's slope (layers backward, fitted on 2048-8192 tokens per rank) and the loss backward within 5%."""
    rows = {(r.case, r.variant): r.predicted / r.value for r in cb.phase_rows(runs["memory_cpu"])}
    if not rows:
        pytest.skip("reports/memory_cpu.rows.json holds no P=4 variant at two lengths (being re-measured?)")
    off = {k: v for k, v in rows.items() if k[0].endswith("/off")}
    assert len(off) == 4 and all(abs(v - 1) <= 0.05 for v in off.values()), off
    assert abs(rows["llama/P4/on", "loss_backward"] - 1) <= 0.05, rows
    assert abs(rows["llama/P4/on", "step (largest slope)"] - 1) <= 0.05, rows
