"""How much memory a training step takes above what the process holds between steps, phase by phase.

A step's cost in memory is its peak *above static*: static is what the process holds just before
the step (weights, gradients, optimizer state, runtime), and the peak is the most it holds during
the step. Measuring "above static" any other way misleads. In particular, subtracting the peak of
a short sequence from the peak of a long one is not a per-token cost: at a short sequence the
optimizer step (a fixed transient, larger when ZeRO partitions over fewer ranks) holds the peak,
not the tokens, so that difference is smaller at P = 1 than at P > 1 for the same per-token bytes.

Where it is measured:
  * CPU on Linux: the kernel's resident set (VmRSS) and its high-water mark (VmHWM), which
    /proc/self/clear_refs resets (Linux >= 4.0), so each phase's own peak is known: every byte the
    process touched, whoever allocated it (torch, DeepSpeed, gloo, the allocator's slack).
  * CUDA: torch's allocated bytes and its peak (reset per phase).
  * elsewhere: no per-step figure (``supported`` is False); only the process's lifetime peak.
"""
from __future__ import annotations

import os
import resource
from typing import Dict, Optional

import torch

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _status_bytes(key: str) -> int:
    with open(_STATUS) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{_STATUS} has no {key} line (Linux only)")


def resident_bytes() -> int:
    """VmRSS: this process's resident memory now."""
    return _status_bytes("VmRSS")


def peak_resident_bytes() -> int:
    """VmHWM: the most resident memory this process has had since the last reset_peak_resident."""
    return _status_bytes("VmHWM")


def reset_peak_resident() -> None:
    """Start VmHWM again from the current resident set (clear_refs value 5)."""
    with open(_CLEAR_REFS, "w") as f:
        f.write("5")


def lifetime_peak_bytes() -> int:
    """The process's largest resident set so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if os.uname().sysname == "Darwin" else rss * 1024


def per_phase_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    return os.path.exists(_CLEAR_REFS) and os.path.exists(_STATUS)


class StepMemory:
    """The peak of each phase of a step, and what the process held before it.

        mem = StepMemory(device)
        mem.begin()                 # static = resident now; phase peaks start here
        mem.mark("forward"); ...    # closes the running phase, starts the named one
        record = mem.end()          # {"static_bytes", "peak_bytes", "above_static_bytes", "peak_phase", "phases"}

    A phase marked again (gradient accumulation) keeps its largest peak. ``watch(module, phase)``
    starts ``phase`` when the gradient of ``module``'s output arrives in backward (e.g. the last
    decoder layer: the layers' backward starts there)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.supported = per_phase_supported(self.device)
        self.phases: Dict[str, int] = {}
        self.current: Optional[str] = None
        self.static = 0
        self._handles = []

    # -- the three primitives, per device -------------------------------------------------------
    def _resident(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return resident_bytes()

    def _peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return peak_resident_bytes()

    def _reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            reset_peak_resident()

    # -- a step ---------------------------------------------------------------------------------
    def begin(self) -> None:
        self.phases, self.current = {}, None
        if self.supported:
            self.static = self._resident()
            self._reset()

    def mark(self, phase: Optional[str]) -> None:
        if not self.supported:
            return
        if self.current is not None:
            self.phases[self.current] = max(self.phases.get(self.current, 0), self._peak())
        self._reset()
        self.current = phase

    def end(self) -> Dict[str, object]:
        if not self.supported:
            peak = lifetime_peak_bytes() if self.device.type != "cuda" else 0
            return {"static_bytes": None, "peak_bytes": peak, "above_static_bytes": None, "peak_phase": None,
                    "phases": {}}
        self.mark(None)
        phase = max(self.phases, key=self.phases.get) if self.phases else None
        peak = self.phases[phase] if phase else self.static
        return {"static_bytes": self.static, "peak_bytes": peak, "above_static_bytes": peak - self.static,
                "peak_phase": phase, "phases": dict(self.phases)}

    def watch(self, module: torch.nn.Module, phase: str) -> None:
        """Start ``phase`` when the gradient of ``module``'s (first) output arrives."""
        def on_forward(mod, args, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda grad: self.mark(phase))
        self._handles.append(module.register_forward_hook(on_forward))

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


__all__ = ["StepMemory", "resident_bytes", "peak_resident_bytes", "reset_peak_resident", "lifetime_peak_bytes",
           "per_phase_supported"]
