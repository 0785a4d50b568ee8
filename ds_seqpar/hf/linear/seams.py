"""The one seam: transformers calls these layers' ops (``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``,
``chunk_kimi_delta_attention``, ``mamba2_chunk_scan``, ``mamba_selective_scan``) as globals of the modeling
file, resolved at call time, with no argument that could say which layer or which sequence-parallel setup is
calling. So the global is replaced by a seam that calls the original unless an applied layer is running, and the
layer's forward pre-hook says which one is, in a context variable (per thread and task, set for the
layer's forward only, reset by its post-hook): other models in the process, and the layer after
remove_sequence_parallel, run transformers' code untouched.

Every seam call is counted per layer; a layer that bypassed a seam (another kernel swapped in, a
fused path) is refused after its forward, before the loss and backward. Under torch.compile each seam
call is one opaque op (opaque.py).
"""
from __future__ import annotations

import contextvars
import inspect
import sys

import torch

from ...errors import UnsupportedModelError
from ..batch_check import KWARG
from .families import FUSED, LAYER_OPS, LIGHTNING, OPTIONAL, calls_per_forward
from .opaque import compiled_seam, run_seam

_PACKING_KWARGS = frozenset({"cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"})
# what the compiled model's pre-hook passes its first attention layer (hf/batch_check.py): the attention's alone
_ATTENTION_KWARGS = _PACKING_KWARGS | {KWARG}
# (mixers, module, {op: calls}) of the applied layer whose forward is running, or None
_RUNNING: contextvars.ContextVar = contextvars.ContextVar("ds_seqpar_linear_layer", default=None)
_TRACED: list = []      # the same, while dynamo traces the forward (_running)


def _seam(name: str, original):
    positional, defaults = _parameters(original)

    def seam(*args, **kwargs):
        running = _running()
        if running is None:
            return original(*args, **kwargs)
        mixers, module, _ = running
        count(name)
        if name in FUSED:
            return None          # the layer then takes its op path (conv + scan), which has the seams
        call = dict(defaults, **dict(zip(positional, args)), **kwargs)
        for name_ in ("cu_seqlens", "seq_idx"):     # packed documents: the mixers cut at them themselves
            call.pop(name_, None)
        if torch.compiler.is_compiling():
            return compiled_seam(mixers, module, name, original, call)
        return run_seam(mixers, module, name, original, call)

    seam._ds_seqpar_original = original
    return seam


def _parameters(original):
    """(the names positional arguments bind to, the defaults): the binding, read once (dynamo cannot
    trace inspect.signature)."""
    # transformers 5.25 wraps each op in a module (so that a hub kernel can replace it): its forward is the op
    fn = original.forward if isinstance(original, torch.nn.Module) else original
    params = inspect.signature(fn).parameters.values()
    positional = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    return positional, {p.name: p.default for p in params if p.default is not p.empty}


def _running():
    """(mixers, module, {op: calls}) of the applied layer whose forward is running, or None. While
    dynamo traces, a plain stack stands in for the context variable (which dynamo cannot trace): the
    traced forward runs on one thread."""
    if torch.compiler.is_compiling():
        return _TRACED[-1] if _TRACED else None
    return _RUNNING.get()


def count(name: str) -> None:
    """One call of op ``name`` by the running layer (lightning attention counts its replaced forward)."""
    calls = _running()[2]
    calls[name] = calls.get(name, 0) + 1


def install_seams(layers) -> None:
    """Replace each op global of the layers' modeling files by its seam, once per process."""
    for _, m in layers:
        module = sys.modules[type(m).__module__]
        for name in LAYER_OPS[type(m).__name__]:
            if name == LIGHTNING:
                continue
            fn = getattr(module, name, None)
            if fn is None and name in OPTIONAL:      # a fused path this release does not have (5.25's Falcon-Mamba)
                continue
            if fn is None:
                raise UnsupportedModelError(f"ds_seqpar.hf: {type(m).__name__}'s modeling file has no {name}: this "
                                            f"transformers version calls another op; the layer cannot be made "
                                            f"sequence-parallel")
            if not hasattr(fn, "_ds_seqpar_original"):
                setattr(module, name, _seam(name, fn))


def layer_hooks(mixers, module) -> list:
    """The pre-hook that marks ``module`` running (and keeps the packing kwargs from its ops) and the
    post-hook that unmarks it and refuses a layer that did not call each of its ops as often as its
    forward does (families.calls_per_forward). In generate's decode steps neither does anything: the
    layer runs transformers' own recurrent step on the whole token and the replicated states."""
    tokens = []

    def pre(module, args, kwargs):
        if torch.compiler.is_compiling():
            _TRACED.append((mixers, module, {}))
        elif mixers.decoding:        # generate's decode step: the layer's own recurrent step (prefill.py)
            tokens.append(None)
            return None
        else:
            tokens.append(_RUNNING.set((mixers, module, {})))
        # the documents reach the mixers through mixers.documents; transformers' layers would pass
        # the call's cu_seqlens on to ops that refuse them (or pass them twice)
        return args, {k: v for k, v in kwargs.items() if k not in _ATTENTION_KWARGS}

    def post(module, args, kwargs, output):
        # always_call: also after an exception (a refusal inside the layer), so no stale mark
        # makes another model's op take the sequence-parallel path
        if torch.compiler.is_compiling():
            calls = _TRACED.pop()[2]
        else:
            token = tokens.pop()
            if token is None:        # a decode step: nothing marked, nothing to count
                return output
            calls = _RUNNING.get()[2]
            _RUNNING.reset(token)
        if output is None:
            return None
        want = calls_per_forward(module)
        calls = dict(calls, **{op: 1 for op in OPTIONAL & set(want) if op not in calls})
        if calls != want:
            raise UnsupportedModelError(f"ds_seqpar.hf: {mixers.where(module)} called {calls or 'no op'} instead of "
                                        f"{want}: the layer bypassed the sequence-parallel seam (another kernel "
                                        f"or a fused path), so its result would be one shard's alone")
        return output

    return [module.register_forward_pre_hook(pre, with_kwargs=True),
            module.register_forward_hook(post, with_kwargs=True, always_call=True)]


__all__ = ["install_seams", "layer_hooks", "count"]
