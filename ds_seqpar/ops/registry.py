"""Handles: the Python objects an opaque op needs (a SequenceParallel, a CommStats, a process group)
named by an int, the only kind of argument a registered op can carry for them. The compiler sees the
int as a constant of the graph; the op's body looks the object up when it runs.

Objects are held weakly where Python allows it (a SequenceParallel that goes away takes its handle
with it); process groups live as long as the world anyway (comm.new_group keeps them).
"""
from __future__ import annotations

import weakref
from typing import Any, Dict

_WEAK: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_STRONG: Dict[int, Any] = {}


def handle(obj: Any) -> int:
    """An int naming ``obj`` while it lives (its id: unique among live objects)."""
    key = id(obj)
    try:
        _WEAK[key] = obj
    except TypeError:                     # not weakly referable (a C++ process group)
        _STRONG[key] = obj
    return key


def resolve(key: int) -> Any:
    obj = _WEAK.get(key, _STRONG.get(key))
    if obj is None:
        raise RuntimeError(f"ds_seqpar: handle {key} names no live object: a compiled graph outlived the "
                           f"SequenceParallel it was traced with; build the model's sp again and recompile")
    return obj


__all__ = ["handle", "resolve"]
