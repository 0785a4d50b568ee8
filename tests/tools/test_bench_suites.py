"""The one list of bench suites (ds_seqpar/bench/suites.py) and everything that names the suites: each listed
suite runs through the command line, its rows carry its name, and the help, docs/benchmarks.md and the
tree of docs/design.md name exactly the listed suites (the README points to that tree). Starts no rank."""
import ast
import glob
import os
import re

import pytest

from ds_seqpar.bench.suites import DEFAULT, SUITES

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
BENCH = os.path.join(ROOT, "ds_seqpar", "bench")
NOT_SUITES = {"plan", "train"}     # rows from plan --calibrate and from report's training runs


def _read(*parts) -> str:
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


@pytest.mark.parametrize("name", list(SUITES))
def test_every_listed_suite_runs_from_the_command_line(name, capsys):
    from ds_seqpar.cli import main
    with pytest.raises(SystemExit) as done:
        main(["bench", name, "--help"])
    assert done.value.code == 0, f"ds-seqpar bench {name} --help exited {done.value.code}"
    usage = capsys.readouterr().out.splitlines()[0]
    prog = "ds-seqpar bench [attention]" if name == DEFAULT else f"ds-seqpar bench {name}"
    assert usage.startswith(f"usage: {prog} "), f"ds-seqpar bench {name} ran another parser: {usage!r}"


def test_the_list_and_the_help_print_every_suite(capsys):
    from ds_seqpar.cli import main, usage
    assert main(["bench", "--list"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == list(SUITES)
    assert ", ".join(SUITES) in usage(), usage()


def _row_suites():
    """{file: [the suite literal of every Row(...) / step_row(...) call in bench/]}."""
    found = {}
    for path in sorted(glob.glob(os.path.join(BENCH, "*.py"))):
        calls = [n for n in ast.walk(ast.parse(open(path).read())) if isinstance(n, ast.Call)
                 and getattr(n.func, "id", None) in ("Row", "step_row") and n.args
                 and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str)]
        found[os.path.basename(path)] = [c.args[0].value for c in calls]
    return found


def test_every_suite_writes_rows_under_its_own_name():
    found = _row_suites()
    strays = {f: sorted(set(s) - set(SUITES)) for f, s in found.items() if set(s) - set(SUITES)}
    assert not strays, f"rows of a suite that bench/suites.py does not list: {strays}"
    silent = [name for name in SUITES if not any(name in s for s in found.values())]
    assert not silent, f"listed suites whose module writes no row under their name: {silent}"


def test_every_bench_command_name_is_a_listed_suite():
    # a module that calls itself `ds-seqpar bench X` is suite X: a new one must be listed
    progs = set()
    for path in glob.glob(os.path.join(BENCH, "*.py")):
        progs |= set(re.findall(r'"ds-seqpar bench ([a-z_]+)"', open(path).read()))
    assert progs and progs <= set(SUITES), sorted(progs - set(SUITES))
    for name in SUITES:
        assert os.path.exists(os.path.join(BENCH, f"{name}.py")), f"{name}: no bench/{name}.py"


def test_committed_rows_name_a_listed_suite():
    files = glob.glob(os.path.join(ROOT, "reports", "**", "*.rows.json"), recursive=True)
    assert files
    from ds_seqpar.report.rows import load_rows
    for path in files:
        suites = {r.suite for r in load_rows(path)[0]}
        assert suites <= set(SUITES) | NOT_SUITES, f"{os.path.relpath(path, ROOT)}: {sorted(suites)}"


def test_the_docs_name_every_suite_and_the_readme_points_to_the_tree():
    page = _read("docs", "benchmarks.md")
    commands = set(re.findall(r"^ds-seqpar bench ([a-z_]+)\b", page, flags=re.M))
    assert commands == set(SUITES) - {DEFAULT}, \
        f"docs/benchmarks.md's commands vs bench/suites.py: {sorted(commands ^ (set(SUITES) - {DEFAULT}))}"
    assert re.search(r"^ds-seqpar bench --preset ", page, flags=re.M), "the default suite's command"
    design = _read("docs", "design.md")
    tree = design[design.index("## 2. The tree as built"):design.index("## 3. The layer rule")]
    listed = set(re.findall(r"^    ([a-z_]+)\.py ", tree[tree.index("  bench/"):tree.index("  report/")], flags=re.M))
    assert set(SUITES) <= listed, f"suites missing from docs/design.md's tree: {sorted(set(SUITES) - listed)}"
    readme = _read("README.md")
    assert "(docs/design.md#2-the-tree-as-built)" in readme, "the README should point to docs/design.md's tree"
    assert "```\nds_seqpar/" not in readme, "the README holds a second copy of the tree: point to docs/design.md"
