"""The rows every suite writes, the one renderer and the one targets table: the table quotes
docs/design.md's performance targets, verdicts scale with the bound, a page shows a table per metric
with only the columns its rows fill, and rows survive a JSON round trip (bench's import circles:
tests/unit/test_layers.py checks the whole package)."""
import os
import sys

import pytest

from ds_seqpar.report.render import render, write
from ds_seqpar.report.rows import Row, load_rows
from ds_seqpar.report.targets import TARGETS, verdict

ROOT = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)

# target -> (how docs/design.md's table "Performance targets" quotes it, the figure in the code)
QUOTED = {"speedup.ulysses": ("Ulysses >= 1.85", 1.85), "speedup.zigzag": ("zigzag >= 1.80", 1.80),
          "speedup.striped": ("striped >= 1.70", 1.70), "speedup.ring": (">= 0.9 of its causal bound", 0.9),
          "speedup.lasp2": (">= 1.85", 1.85), "vs_deepspeed": ("<= 1.00", 1.0), "bytes": ("== 1.000", 1.0),
          "activation_memory": ("<= 1/P + 0.02", 0.02), "max_seq": (">= 1.9", 1.9), "train_step": (">= 1.8", 1.8),
          "packed": ("<= 0.20", 0.20), "window": ("<= 1.3", 1.3), "sinks": ("<= 1.03", 1.03),
          "hybrid_layer": (">= 1.7", 1.7), "trainer": ("<= 1.05", 1.05), "memory.features_vs_plain": ("<= 1/8", 1 / 8),
          "memory.features_vs_floor": ("<= 3", 3.0), "memory.p2_vs_p1": ("0.90-1.10", 0.10),
          "memory.max_seq": (">= 1.95", 1.95), "memory.peak_p2_vs_p1": ("<= 1.10", 1.10),
          "memory.strategy_p2": ("0.90-1.10", 0.10), "memory.strategy_p4": ("0.85-1.15", 0.15),
          "memory.time_vs_implied": ("<= 1.10", 1.10), "posttrain.dpo": (">= 1.7", 1.7),
          "posttrain.logprob_chunks": ("<= 4", 4.0), "posttrain.grpo": (">= 1.7", 1.7),
          "generate.prefill": (">= 1.7; >= 1.0", 1.7), "generate.decode": (">= 1.7; >= 1.0", 1.0)}


def _design_targets() -> str:
    with open(os.path.join(ROOT, "docs", "design.md")) as f:
        text = f.read()
    section = text[text.index("## 6. Performance targets"):]
    return "\n".join(line for line in section.splitlines() if line.startswith("| "))


def test_every_target_is_quoted_from_the_design_table():
    table = _design_targets()
    assert set(QUOTED) == set(TARGETS), set(QUOTED) ^ set(TARGETS)
    for key, (quote, figure) in QUOTED.items():
        assert quote in table, f"{key}: {quote!r} not in docs/design.md's targets table"
        assert TARGETS[key].figure == pytest.approx(figure) and TARGETS[key].op in quote.replace("-", "within"), key


def test_verdicts_scale_with_the_bound_and_exact_checks_fail():
    assert verdict("speedup.zigzag", [1.81], 2.0) == "PASS" and verdict("speedup.zigzag", [1.79], 2.0) == "SHORT"
    assert verdict("speedup.zigzag", [3.59], 4.0) == "SHORT" and verdict("speedup.zigzag", [3.61], 4.0) == "PASS"
    assert verdict("speedup.ring", [1.21], 4 / 3) == "PASS" and verdict("speedup.ring", [1.19], 4 / 3) == "SHORT"
    assert verdict("activation_memory", [0.519], 0.5) == "PASS" and verdict("activation_memory", [0.521], 0.5) == "SHORT"
    assert verdict("bytes", [1.0, 1.0]) == "PASS" and verdict("bytes", [1.0, 1.001]) == "FAIL"
    assert verdict("memory.p2_vs_p1", [0.91]) == "PASS" and verdict("memory.p2_vs_p1", [1.11]) == "SHORT"


ROWS = [Row("attention", "zigzag", "N=8192", "speedup", "x", 1.7, (1.6, 1.8), bound=2.0, target="speedup.zigzag",
            detail={"why": "compute itself", "CPU ratio": 1.9}),
        Row("attention", "ring", "N=8192", "speedup", "x", 1.3, (1.2, 1.4), bound=4 / 3, target="speedup.ring"),
        Row("attention", "ring", "N=8192", "bytes per rank / closed form", "B", [96, 0], predicted=[96, 0],
            target="bytes"),
        Row("attention", "single", "N=8192", "wall s", "s", 1.25)]


def test_one_table_per_metric_with_the_columns_its_rows_fill():
    page = render(ROWS, {"title": "T", "command": "ds-seqpar bench x", "metrics": {"speedup": "what it means"}})
    assert page.startswith("# T\n") and "Command: `ds-seqpar bench x`" in page
    targets = page[page.index("## Targets"):page.index("## speedup")]
    assert "| speedup | zigzag | N=8192 | 1.700 | 2.000 | >= 1.80 | **SHORT** | compute itself |" in targets, targets
    assert "| speedup | ring | N=8192 | 1.300 | 1.333 | >= 1.20 | **PASS** |" in targets, targets
    assert "| bytes per rank / closed form | every case | 1 rows | 1.000 |" in targets, targets
    assert "what it means" in page and "| zigzag | N=8192 | 1.700 (1.600-1.800) |" in page, page
    assert "| ring | N=8192 | 96 / 0 | 96 / 0 | 1.000 / 1.000 | == 1.000 | **PASS** |" in page, page
    wall = page[page.index("## wall s"):]
    assert wall.splitlines()[2] == "| case | variant | value s |" and "| single | N=8192 | 1.250 |" in wall, wall


def test_rows_round_trip_through_json(tmp_path):
    facts = {"title": "T"}
    md = write(str(tmp_path), "x", ROWS, facts)
    rows, back = load_rows(str(tmp_path / "x.rows.json"))
    assert rows == ROWS and back == facts
    assert open(md).read() == render(rows, back)


def test_report_re_renders_saved_rows(tmp_path):
    from ds_seqpar.report.main import main
    write(str(tmp_path), "x", ROWS, {"title": "T"})
    assert main(["--rows", str(tmp_path / "x.rows.json"), "--out", str(tmp_path / "again.md")]) == 0
    assert (tmp_path / "again.md").read_text() == (tmp_path / "x.md").read_text()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
