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


__all__ = ["command_line", "machine_facts"]
