"""An applied linear layer's seam call under torch.compile: one opaque, differentiable node,
``ds_seqpar::linear_layer``, whose body is the eager sequence-parallel path (the conv halo, the state
exchange or the heads all-to-all with the family's op around it), so the compiler never traces a
collective. Its backward, ``ds_seqpar::linear_layer_backward``, runs that path again with autograd
on and takes the gradients of the inputs: the same operations in the same order as the eager
backward, so the same numbers, for one more forward of the layer's mixer (and its forward
exchange: sp.stats counts it twice under compile).

What is not a tensor (the op's options, which layer, which sequence-parallel setup) is named by a
string key, a constant of the graph, registered while dynamo traces the seam (``key`` runs then,
once per compiled graph, not inside it); the fake runs the seam's original on the local shard
(transformers' own op; for lightning attention, which has none, a shape function), whose output has
the shape the sequence-parallel path returns.

Packed documents: the layers cut the exchange and the conv halo at the documents on the host
(mixers.documents, a list of ints). Under compile the bounds arrive as the model's cu_seqlens tensor,
an input of the op like the activations, and the op's body (forward and backward) reads its host copy
into mixers.documents for its run: a new packing is new data, not a new graph. Bounds given as a list
are constants of the graph, as for sp.attention."""
from __future__ import annotations

import contextlib
import weakref
from typing import Dict, List, Optional

import torch
from torch import Tensor

from ...ops.attention import UNSAFE_FOR_CUDA_GRAPHS, _outputs
from ...ops.registry import handle, resolve
from .families import CONV, LIGHTNING, SCAN, SSD

_ENTRIES: Dict[str, tuple] = {}       # key -> (mixers handle, module ref, op name, original, tensor names, constants)
_SINGLE = frozenset({CONV, SSD, SCAN, LIGHTNING})   # the ops that return one tensor; the delta rules return (out, None)
DOCUMENTS = "ds_seqpar_documents"         # the packed-document bounds' entry in the op's call (no op has one)


def run_seam(mixers, module, name: str, original, call: dict):
    """The sequence-parallel path of op ``name`` for the applied ``module`` (eager, or the op's body)."""
    if name == CONV:
        return mixers.conv(original, call)
    if name == SSD:
        return mixers.ssd(original, call, mixers.where(module))
    if name == SCAN:
        return mixers.selective_scan(original, call, mixers.where(module))
    if name == LIGHTNING:
        return mixers.lightning(module, call, mixers.where(module))
    return mixers.delta_rule(original, call, mixers.where(module))


@torch._dynamo.assume_constant_result
def key(mixers, module, name: str, original, names: tuple, constants: tuple) -> str:
    """Runs while dynamo traces (its result is a constant of the graph)."""
    text = f"{handle(mixers)}|{id(module)}|{name}|{names}|{constants!r}"
    _ENTRIES[text] = (handle(mixers), weakref.ref(module), name, original, names, dict(constants))
    return text


def compiled_seam(mixers, module, name: str, original, call: dict):
    """The seam's result under compile, through the op."""
    if mixers.documents is not None:     # a tensor (an input of the op) or a list (constants)
        docs = mixers.documents
        call = dict(call, **{DOCUMENTS: docs if isinstance(docs, Tensor) else tuple(int(d) for d in docs)})
    names = tuple(k for k, v in call.items() if isinstance(v, Tensor))
    constants = tuple((k, v) for k, v in call.items() if not isinstance(v, Tensor))
    out = linear_layer_op([call[k] for k in names], key(mixers, module, name, original, names, constants))
    return out if name in _SINGLE else (out, None)


def _call(key_: str, tensors):
    """(mixers, module, op name, transformers' op, its call, the documents or None)."""
    mixers_key, module, name, original, names, constants = _ENTRIES[key_]
    call = dict(constants, **dict(zip(names, tensors)))
    return resolve(mixers_key), module(), name, original, call, call.pop(DOCUMENTS, None)


def _run(key_: str, tensors) -> Tensor:
    mixers, module, name, original, call, docs = _call(key_, tensors)
    with _documents(mixers, docs):
        out = run_seam(mixers, module, name, original, call)
    return out if name in _SINGLE else out[0]


@contextlib.contextmanager
def _documents(mixers, docs):
    """The op's documents as mixers.documents for its run (a list on the host, as the eager pre-hook sets)."""
    before = mixers.documents
    mixers.documents = None if docs is None else docs.tolist() if isinstance(docs, Tensor) else list(docs)
    try:
        yield
    finally:
        mixers.documents = before


@torch.library.custom_op("ds_seqpar::linear_layer", mutates_args=(), tags=UNSAFE_FOR_CUDA_GRAPHS)
def linear_layer_op(tensors: List[Optional[Tensor]], key: str) -> Tensor:
    return _outputs([_run(key, tensors)], tensors)[0]


@linear_layer_op.register_fake
def _linear_layer_fake(tensors, key):
    _, _, name, original, call, _ = _call(key, tensors)
    out = original(**call)
    return (out if name in _SINGLE else out[0]).contiguous()      # the real op's outputs are (_outputs)


@torch.library.custom_op("ds_seqpar::linear_layer_backward", mutates_args=(), tags=UNSAFE_FOR_CUDA_GRAPHS)
def linear_layer_backward_op(grad: Tensor, tensors: List[Optional[Tensor]], key: str) -> List[Tensor]:
    """Each input's gradient (zeros for one the output does not depend on; empty for a None)."""
    leaves = [None if t is None else t.detach().requires_grad_(t.is_floating_point()) for t in tensors]
    wants = [t for t in leaves if t is not None and t.requires_grad]
    with torch.enable_grad(), _autograd_on():
        out = _run(key, leaves)
    grads = iter(torch.autograd.grad(out, wants, grad, allow_unused=True))
    result = []
    for t in leaves:
        g = next(grads) if t is not None and t.requires_grad else None
        result.append(torch.empty(0, device=grad.device) if t is None else _gradient(t, g))
    return _outputs(result, [grad, *tensors])


def _autograd_on():
    """An op's body runs below autograd (its dispatch key excluded, whatever the grad mode): the
    backward's rerun must record, so autograd is let back in for it."""
    exclude = torch._C._dispatch_tls_local_exclude_set().remove(torch._C.DispatchKey.AutogradFunctionality)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def _gradient(t: Tensor, g: Optional[Tensor]) -> Tensor:
    return torch.zeros_like(t) if g is None else g


@linear_layer_backward_op.register_fake
def _linear_layer_backward_fake(grad, tensors, key):
    contiguous = torch.contiguous_format                     # as _outputs makes the real gradients
    return [torch.empty(0, device=grad.device) if t is None else torch.empty_like(t, memory_format=contiguous)
            for t in tensors]


def _setup(ctx, inputs, output):
    tensors, key_ = inputs
    ctx.present = [t is not None for t in tensors]
    ctx.save_for_backward(*(t for t in tensors if t is not None))
    ctx.key = key_


def _backward(ctx, grad):
    saved = iter(ctx.saved_tensors)
    tensors = [next(saved) if p else None for p in ctx.present]
    grads = linear_layer_backward_op(grad, tensors, ctx.key)
    return [g if t is not None and t.is_floating_point() else None for g, t in zip(grads, tensors)], None


torch.library.register_autograd("ds_seqpar::linear_layer", _backward, setup_context=_setup)

__all__ = ["run_seam", "compiled_seam", "linear_layer_op", "linear_layer_backward_op"]
