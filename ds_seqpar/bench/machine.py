"""What every bench page records about its run: the machine and versions, and the command as typed."""
from __future__ import annotations

import os
import platform
import shlex
from typing import Any, Dict, List


def machine_facts() -> Dict[str, Any]:
    """CPU model, core count, Python, torch and DeepSpeed versions, and the load when asked."""
    import deepspeed
    import torch
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu_model": model, "cpus": os.cpu_count(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "python": platform.python_version(), "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg())}


def command_line(prefix: str, argv: List[str]) -> str:
    """``prefix`` and the arguments, shell-quoted; --notes text is printed in the page, not here."""
    shown, skip = [], False
    for a in argv:
        if skip or a.startswith("--notes="):
            skip = False
            continue
        skip = a == "--notes"
        if not skip:
            shown.append(shlex.quote(a))
    return " ".join([prefix] + shown)


def run_lines(meta: Dict[str, Any]) -> List[str]:
    """The page lines saying how a one-page bench mode ran (--window, --hybrid): the command and the
    machine with its load (meta from packed.measure_on_pool plus machine_facts)."""
    return [f"Command: `{meta['command']}`", "",
            f"Machine: {meta.get('cpu_model', '?')}, {meta['cpus']} CPUs, torch {meta.get('torch', '?')}, shared with "
            f"other engineers' jobs: load average before {meta['load_before']}, after {meta['load_after']}, highest "
            f"1-minute value at the end of the rounds {meta['load_during']:.2f}; whole run {meta['elapsed']:.0f} s.", ""]


__all__ = ["command_line", "machine_facts", "run_lines"]
