"""Linear-attention and convolution layers of Hugging Face hybrids under sequence parallelism.

transformers has no registry for these layers, but the ones we support call module-level ops that
Python resolves at call time: ``causal_conv1d_fn`` (every short causal conv),
``torch_chunk_gated_delta_rule`` (gated DeltaNet: Qwen3-Next, Qwen3.5, OLMo-Hybrid) and
``chunk_kimi_delta_attention`` (Kimi delta attention: Kimi-Linear, Ling bailing_hybrid). The
modeling file's global is replaced by a seam that calls the original unless an applied layer is
running (a forward pre-hook on each such layer says so), so other models in the process, and the
layer after remove_sequence_parallel, run transformers' code untouched. Projections, gates, norms
and GQA stay transformers' code; only the sequence-mixing op and the conv become sequence-parallel:

  * conv: each fragment (run of consecutive global tokens a rank holds) is convolved with the K-1
    inputs before it (state_passing.halos), and the first K-1 outputs dropped;
  * delta rule, ``linear_strategy: lasp``: one call of the original op on the widened problem
    (values [v, 0_K], initial state [0, I_K]) returns, by linearity, the zero-init output o0, the
    effective queries Q~ = (A_{<=t}^T q_t), and the fragment's map (A, B) as the final state
    [B | A]; state_passing.states_in folds the maps in global order (allgather or ring); then
    o = o0 + Q~ . S_in. Autograd gives the backward (the maps' all-gather has a reduce-scatter dual);
  * delta rule, ``linear_strategy: ulysses``: all-to-all to whole sequences of P-th of the heads,
    the original op, all-to-all back (heads must divide by P).

Every seam call is counted per layer; a layer that bypassed a seam (another kernel swapped in, a
fused path) is refused after its forward, before the loss and backward.
"""
from __future__ import annotations

import inspect
import sys
from typing import Dict, List, Tuple

import torch
import torch.nn as nn

from .. import comm
from ..strategies.state_passing import check_fragments, fragments, halos, states_in
from .checks import UnsupportedModelError

CONV = "causal_conv1d_fn"
DELTA_OPS = ("torch_chunk_gated_delta_rule", "chunk_kimi_delta_attention")
_GDN = (CONV, "torch_chunk_gated_delta_rule")
_KDA = (CONV, "chunk_kimi_delta_attention")
# layer class -> the module-level ops its training forward calls, each exactly once
LAYER_OPS: Dict[str, Tuple[str, ...]] = {
    "Qwen3NextGatedDeltaNet": _GDN, "Qwen3_5GatedDeltaNet": _GDN, "Qwen3_5MoeGatedDeltaNet": _GDN,
    "OlmoHybridGatedDeltaNet": _GDN,
    "KimiLinearDeltaAttention": _KDA, "BailingHybridDeltaAttention": _KDA,
    "Lfm2ShortConv": (CONV,), "Lfm2MoeShortConv": (CONV,), "Lfm3ShortConv": (CONV,),
}
LINEAR_LAYER_TYPES = ("linear_attention", "conv")

_ACTIVE: List[list] = []           # [mixers, module, {op: calls}] of the applied layer now running


def linear_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ in LAYER_OPS]


def _seam(name: str, original):
    def seam(*args, **kwargs):
        if not _ACTIVE:
            return original(*args, **kwargs)
        mixers, module, calls = _ACTIVE[-1]
        calls[name] = calls.get(name, 0) + 1
        bound = inspect.signature(original).bind(*args, **kwargs)
        bound.apply_defaults()
        call = dict(bound.arguments)
        call.update(call.pop("kwargs", {}))
        if name == CONV:
            return mixers.conv(original, call)
        return mixers.delta_rule(original, call, mixers.where(module))

    seam._ds_seqpar_original = original
    return seam


def install_seams(layers) -> None:
    """Replace each op global of the layers' modeling files by its seam, once per process."""
    for _, m in layers:
        module = sys.modules[type(m).__module__]
        for name in LAYER_OPS[type(m).__name__]:
            fn = getattr(module, name, None)
            if fn is None:
                raise UnsupportedModelError(f"ds_seqpar.hf: {type(m).__name__}'s modeling file has no {name}: this "
                                            f"transformers version calls another op; the layer cannot be made "
                                            f"sequence-parallel")
            if not hasattr(fn, "_ds_seqpar_original"):
                setattr(module, name, _seam(name, fn))


def delta_rule_map(original, q, k, v, g, beta, call: dict):
    """One fragment of a delta-rule op as an affine map of its entering state, from one call of the
    op on the widened problem (values [v, 0_dk], initial state [0, I_dk]): returns (o0, Q~, A, B)
    with o0 the zero-state output [b, l, h, dv], Q~ the effective queries [b, l, h, dk] (fp32),
    and the final state = A . S_in + B, A [b, h, dk, dk], B [b, h, dk, dv] (fp32)."""
    dk, dv = q.shape[-1], v.shape[-1]
    h0 = torch.zeros(v.shape[0], v.shape[2], dk, dv + dk, dtype=torch.float32, device=v.device)
    h0[..., dv:] = torch.eye(dk, dtype=torch.float32, device=v.device)
    wide = torch.cat([v, v.new_zeros(v.shape[:-1] + (dk,))], -1)
    out, final = original(q, k, wide, g=g, beta=beta, initial_state=h0, output_final_state=True, **call)
    return out[..., :dv], out[..., dv:].float(), final[..., dv:], final[..., :dv]


def with_state_in(o0, q_eff, s_in):
    """o = o0 + Q~ . S_in, in o0's dtype."""
    return (o0.float() + torch.einsum("blhk,bhkv->blhv", q_eff, s_in.float())).to(o0.dtype)


class LinearMixers:
    """The sequence-parallel ops for one applied (sp, model) pair."""

    def __init__(self, sp, layers):
        self.sp = sp
        self.names = {id(m): f"{n} ({type(m).__name__})" for n, m in layers}
        self._frags = {}

    def where(self, module) -> str:
        return self.names.get(id(module), type(module).__name__)

    def hooks(self, layers) -> list:
        def pre(module, args, kwargs):
            _ACTIVE.append([self, module, {}])

        def post(module, args, kwargs, output):
            # always_call: also after an exception (a refusal inside the layer), so no stale entry
            # makes another model's op take the sequence-parallel path
            _, _, calls = _ACTIVE.pop()
            if output is None:
                return None
            want = {op: 1 for op in LAYER_OPS[type(module).__name__]}
            if calls != want:
                raise UnsupportedModelError(f"ds_seqpar.hf: {self.where(module)} called {calls or 'no op'} instead of "
                                            f"{want}: the layer bypassed the sequence-parallel seam (another kernel "
                                            f"or a fused path), so its result would be one shard's alone")
            return output

        handles = []
        for _, m in layers:
            handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(m.register_forward_hook(post, with_kwargs=True, always_call=True))
        return handles

    def fragments(self, local_len: int, width: int, where: str):
        n = local_len * self.sp.size
        if n not in self._frags:
            self._frags[n] = fragments(self.sp.layout, n)
        frags = self._frags[n]
        check_fragments(frags, width, where)
        return frags

    # -- the ops -------------------------------------------------------------------------------

    def conv(self, original, call: dict):
        x = call.pop("hidden_states")                            # [b, channels, local tokens]
        width = call["weight"].shape[-1] - 1
        if width == 0:
            return original(x, **call)
        frags = self.fragments(x.shape[-1], width, f"a causal conv1d of kernel {width + 1}")
        before = halos(x, width, frags, self.sp.rank, self.sp.group, self.sp.stats)
        outs = [original(torch.cat([h.to(x.dtype), x[..., off:off + n]], -1), **call)[..., width:]
                for h, (_, n, off) in zip(before, frags[self.sp.rank])]
        return outs[0] if len(outs) == 1 else torch.cat(outs, -1)

    def delta_rule(self, original, call: dict, where: str):
        if call.get("initial_state") is not None or call.get("output_final_state"):
            raise UnsupportedModelError(f"ds_seqpar.hf: a recurrent state cache in {where} cannot be exact under "
                                        f"sequence parallelism; train with use_cache=False")
        q, k, v, g, beta = (call.pop(n) for n in ("query", "key", "value", "g", "beta"))
        call.pop("initial_state"), call.pop("output_final_state")
        if self.sp.config.linear_strategy == "ulysses":
            return self._delta_ulysses(original, q, k, v, g, beta, call, where), None
        frags = self.fragments(q.shape[1], 1, where)
        pieces = [delta_rule_map(original, q[:, off:off + n], k[:, off:off + n], v[:, off:off + n], g[:, off:off + n],
                                 beta[:, off:off + n], call) for _, n, off in frags[self.sp.rank]]
        s_in = states_in(torch.stack([p[2] for p in pieces]), torch.stack([p[3] for p in pieces]), frags,
                         self.sp.rank, self.sp.group, self.sp.stats, self.sp.config.lasp_comm)   # [nf, b, h, dk, dv]
        outs = [with_state_in(o0, q_eff, s) for (o0, q_eff, _, _), s in zip(pieces, s_in)]
        return (outs[0] if len(outs) == 1 else torch.cat(outs, 1)), None

    def _delta_ulysses(self, original, q, k, v, g, beta, call, where):
        sp = self.sp
        for name, heads in (("key heads", q.shape[2]), ("value heads", v.shape[2])):
            if heads % sp.size:
                raise UnsupportedModelError(f"ds_seqpar.hf: {where} has {heads} {name}, not divisible by "
                                            f"sequence_parallel.size={sp.size}: linear_strategy 'ulysses' splits "
                                            f"heads over ranks; use linear_strategy 'lasp'")
        n = q.shape[1] * sp.size
        inverse, perm = sp.layout.inverse(n, q.device), sp.layout.permutation(n, q.device)

        def to_heads(x):                 # [b, local, h, ...] -> [b, n (global order), h / P, ...]
            return comm.all_to_all(x.contiguous(), 2, 1, sp.group, sp.stats, "linear_all_to_all").index_select(1, inverse)

        out, _ = original(to_heads(q), to_heads(k), to_heads(v), g=to_heads(g), beta=to_heads(beta),
                          initial_state=None, output_final_state=False, **call)
        return comm.all_to_all(out.index_select(1, perm).contiguous(), 1, 2, sp.group, sp.stats, "linear_all_to_all")


__all__ = ["LAYER_OPS", "LINEAR_LAYER_TYPES", "LinearMixers", "install_seams", "linear_modules", "delta_rule_map",
           "with_state_in"]
