"""Handles: the Python objects an opaque op needs (a SequenceParallel, a CommStats, a process group)
named by a string, a kind of argument a registered op can carry for them. The compiler sees the
string as a constant of the graph (an int would not stay one: when a second object goes through the
same compiled code, dynamo makes a changed int dynamic, a SymInt the op cannot look up); the op's body
looks the object up when it runs.

Objects are held weakly where Python allows it (a SequenceParallel that goes away takes its handle
with it); process groups live as long as the world anyway (comm.new_group keeps them).
"""
from __future__ import annotations

import weakref
from typing import Any, Dict

_WEAK: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()
_STRONG: Dict[str, Any] = {}


def key_of(obj: Any) -> str:
    """The name ``handle`` gives ``obj`` (from its id: unique among live objects); traceable."""
    return f"h{id(obj)}"


def handle(obj: Any) -> str:
    """A string naming ``obj`` while it lives."""
    key = key_of(obj)
    try:
        _WEAK[key] = obj
    except TypeError:                     # not weakly referable (a C++ process group)
        _STRONG[key] = obj
    return key


def resolve(key: str) -> Any:
    obj = _WEAK.get(key, _STRONG.get(key))
    if obj is None:
        raise RuntimeError(f"ds_seqpar: handle {key} names no live object: a compiled graph outlived the "
                           f"SequenceParallel it was traced with; build the model's sp again and recompile")
    return obj


__all__ = ["handle", "key_of", "resolve"]
