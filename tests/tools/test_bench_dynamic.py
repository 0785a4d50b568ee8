"""ds-seqpar bench dynamic without ranks: its cases and the committed report, which is its rows
rendered again (ds-seqpar bench dynamic --render reports/dynamic_cpu_p4_16k.rows.json)."""
import os

import pytest

from ds_seqpar.bench.dynamic import cases
from ds_seqpar.report.render import render
from ds_seqpar.report.rows import load_rows

REPORTS = os.path.join(os.path.dirname(__file__), "..", "..", "reports")


def test_every_static_size_and_dynamic_at_the_tokens_per_rank_each_holds():
    got = {name: (c["size"], c["per_rank"]) for name, c in cases(4, 512).items()}
    assert got == {"static:1": (1, 2048), "static:2": (2, 1024), "static:4": (4, 512), "dynamic": ("dynamic", 512),
                   "dynamic:T=1024": ("dynamic", 1024)}


@pytest.mark.parametrize("name", ["dynamic_cpu_p2", "dynamic_cpu_p4", "dynamic_cpu_p2_16k", "dynamic_cpu_p4_16k"])
def test_the_committed_page_is_its_rows_rendered(name):
    rows, facts = load_rows(os.path.join(REPORTS, f"{name}.rows.json"))
    with open(os.path.join(REPORTS, f"{name}.md")) as f:
        assert render(rows, facts) == f.read()
    names = {(r.case, r.metric) for r in rows}
    assert {("dynamic", "critical_cpu_s"), ("static:2", "tokens_per_s")} <= names


def test_the_predicted_page_is_its_rows_and_each_prediction_comes_from_the_other_cases_fit():
    import dataclasses
    from ds_seqpar.bench.dynamic_fit import with_predictions
    rows, facts = load_rows(os.path.join(REPORTS, "dynamic_cpu_predicted.rows.json"))
    with open(os.path.join(REPORTS, "dynamic_cpu_predicted.md")) as f:
        assert render(rows, facts) == f.read()
    bare = [dataclasses.replace(r, predicted=None) for r in rows]
    again, _ = with_predictions(bare, facts["meta"]["priced_work"])
    timed = [(r, a) for r, a in zip(rows, again) if r.metric == "critical_cpu_s"]
    assert len(timed) == 16 and all(r.predicted == a.predicted for r, a in timed)
    assert {r.variant.split()[1] for r, _ in timed} == {"P=2", "P=4"}
