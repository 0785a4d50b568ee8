"""The README's test command collects every tier.

pytest skips folders named like build outputs (its default ``norecursedirs`` includes ``dist``),
so a tier can drop out of ``python -m pytest -q`` with no error at all. This test asks pytest what
the plain command would collect and requires each test file of every tier to be in it. Inside the plain
command itself (arguments from setup.cfg's testpaths, run from the root) the answer is the session's own
collection (tests/conftest.py records it), so the suite does not collect twice; otherwise a subprocess
runs the plain collection.
"""
import pathlib
import subprocess
import sys

import pytest

from ..conftest import COLLECTED

ROOT = pathlib.Path(__file__).resolve().parents[2]
TIERS = ("unit", "dist", "e2e", "tools")


def plain_collection(config) -> set:
    """The test files ``python -m pytest`` collects from the root: this session's, when it is that command."""
    here = pathlib.Path(config.invocation_params.dir).resolve() == ROOT
    if here and config.args_source == pytest.Config.ArgsSource.TESTPATHS:
        return config.stash.get(COLLECTED, set())
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return {line.split("::")[0] for line in out.stdout.splitlines() if "::" in line}


def test_plain_pytest_collects_every_test_file_of_every_tier(request):
    collected = plain_collection(request.config)
    expected = {str(p.relative_to(ROOT)) for tier in TIERS for p in (ROOT / "tests" / tier).glob("test_*.py")}
    assert expected, "no test files found: the tiers moved?"
    missing = sorted(expected - collected)
    assert not missing, f"python -m pytest does not collect: {missing}"
