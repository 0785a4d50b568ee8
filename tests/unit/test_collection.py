"""The README's test command collects every tier.

pytest skips folders named like build outputs (its default ``norecursedirs`` includes ``dist``),
so a tier can drop out of ``python -m pytest -q`` with no error at all. This test asks pytest what
the plain command would collect and requires each test file of every tier to be in it.
"""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
TIERS = ("unit", "dist", "e2e", "tools")


def test_plain_pytest_collects_every_test_file_of_every_tier():
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    collected = {line.split("::")[0] for line in out.stdout.splitlines() if "::" in line}
    expected = {str(p.relative_to(ROOT)) for tier in TIERS for p in (ROOT / "tests" / tier).glob("test_*.py")}
    assert expected, "no test files found: the tiers moved?"
    missing = sorted(expected - collected)
    assert not missing, f"python -m pytest does not collect: {missing}"
