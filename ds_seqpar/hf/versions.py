"""The Hugging Face releases ds_seqpar is tested with, and the refusal of any other.

transformers ships monthly and renames what ds_seqpar hooks into (5.24 renamed the layers' cache argument:
DeepSeek sparse attention then crashed with a raw size error; 5.25 wrapped the hybrids' ops in modules, which
the linear layers' seams now bind through). The suite runs against the pinned set (constraints.txt, CI) and,
before a change lands, against the newest releases on the index (the README's "latest" tier); TESTED holds the
range both cover, and setup.cfg's bounds say the same (tests/unit/test_hf_checks.py). A release outside it is
refused by name when sequence parallelism is applied, before any collective, unless the user says to try it
(DS_SEQPAR_UNTESTED_OK=1).
"""
from __future__ import annotations

import functools
import os
import re
from importlib import metadata
from typing import Dict, Tuple

from .checks import UnsupportedModelError

# package -> (lowest tested, first untested)
TESTED: Dict[str, Tuple[str, str]] = {"transformers": ("5.23.0", "5.26.0"), "trl": ("1.16.0", "1.17.0"),
                                      "accelerate": ("1.15.0", "1.17.0")}
OVERRIDE = "DS_SEQPAR_UNTESTED_OK"


def _key(version: str) -> Tuple[int, ...]:
    """'5.24.0', '5.25.0.dev0', '1.16.0rc1' -> (5, 24, 0): the release numbers alone."""
    return tuple(int(re.match(r"\d*", part).group() or 0) for part in version.split(".")[:3])


@functools.lru_cache(maxsize=None)        # a release does not change under a running process; the lookup scans
def installed(package: str):              # the environment's distributions (ms), once per applied model before
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


# model classes a transformers release breaks by itself (the unsharded model fails too): (class, first broken,
# first fixed or None, what breaks). Refused by name at apply time, with what works, instead of failing inside.
UPSTREAM_BREAKS = [
    ("Llama4ForConditionalGeneration", "5.24.0", None,
     "its forward reads image_outputs from the language model's output, which has none (an AttributeError in "
     "the unsharded model too)"),
]


def upstream_break(model_class: str, version=None):
    """What breaks ``model_class`` in the installed (or given) transformers release, or None."""
    version = version or installed("transformers")
    if version is None:
        return None
    for name, first, fixed, what in UPSTREAM_BREAKS:
        if name == model_class and _key(first) <= _key(version) and (fixed is None or _key(version) < _key(fixed)):
            return f"transformers {version} breaks {name}: {what}"
    return None


def check_upstream(model) -> None:
    why = upstream_break(type(model).__name__)
    if why is not None:
        raise UnsupportedModelError(f"ds_seqpar.hf: {why}; use transformers>=5.23.0,<5.24 for this model (or its text "
                                    f"model alone)")


def check_tested(packages=("transformers",), env=None) -> None:
    """Refuse an installed release of ``packages`` outside TESTED (a package not installed passes: whoever
    imports it says so)."""
    env = os.environ if env is None else env
    if env.get(OVERRIDE) == "1":
        return
    for package in packages:
        version = installed(package)
        if version is None:
            continue
        low, high = TESTED[package]
        if not _key(low) <= _key(version) < _key(high):
            raise UnsupportedModelError(
                f"ds_seqpar.hf: {package} {version} is outside the range ds_seqpar is tested with "
                f"({package}>={low},<{high}); install a tested release (pip install '{package}>={low},<{high}'), "
                f"or set {OVERRIDE}=1 to try this one (the README's latest tier tests a new release)")


__all__ = ["TESTED", "OVERRIDE", "UPSTREAM_BREAKS", "check_tested", "check_upstream", "upstream_break", "installed"]
