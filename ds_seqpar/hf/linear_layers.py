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
SSD = "mamba2_chunk_scan"
FUSED = "mamba2_split_conv1d_scan_combined"     # mamba_ssm's whole-layer kernel: no state input, switched off
OPTIONAL = frozenset({FUSED})                   # called in training only
_GDN = (CONV, "torch_chunk_gated_delta_rule")
_KDA = (CONV, "chunk_kimi_delta_attention")
_MAMBA2 = (FUSED, CONV, SSD)
# layer class -> the module-level ops its training forward calls, each exactly once
LAYER_OPS: Dict[str, Tuple[str, ...]] = {
    "Qwen3NextGatedDeltaNet": _GDN, "Qwen3_5GatedDeltaNet": _GDN, "Qwen3_5MoeGatedDeltaNet": _GDN,
    "OlmoHybridGatedDeltaNet": _GDN,
    "KimiLinearDeltaAttention": _KDA, "BailingHybridDeltaAttention": _KDA,
    "Lfm2ShortConv": (CONV,), "Lfm2MoeShortConv": (CONV,), "Lfm3ShortConv": (CONV,),
    "Mamba2Mixer": _MAMBA2, "BambaMixer": _MAMBA2, "GraniteMoeHybridMambaLayer": _MAMBA2,
    "NemotronHMamba2Mixer": _MAMBA2, "FalconH1Mixer": _MAMBA2, "Zamba2MambaMixer": _MAMBA2,
}
# layer types that hold an adapted mixer (checks.check_modules verifies each does); "hybrid":
# Falcon-H1's attention and Mamba2 side by side
LINEAR_LAYER_TYPES = ("linear_attention", "conv", "mamba", "hybrid")

_ACTIVE: List[list] = []           # [mixers, module, {op: calls}] of the applied layer now running


def linear_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ in LAYER_OPS]


def _seam(name: str, original):
    def seam(*args, **kwargs):
        if not _ACTIVE:
            return original(*args, **kwargs)
        mixers, module, calls = _ACTIVE[-1]
        calls[name] = calls.get(name, 0) + 1
        if name == FUSED:
            return None          # the layer then takes its op path (conv + scan), which has the seams
        bound = inspect.signature(original).bind(*args, **kwargs)
        bound.apply_defaults()
        call = dict(bound.arguments)
        call.update(call.pop("kwargs", {}))
        if name == CONV:
            return mixers.conv(original, call)
        if name == SSD:
            return mixers.ssd(original, call, mixers.where(module))
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
            calls = dict(calls, **{op: 1 for op in OPTIONAL & set(want) if op not in calls})
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

    def ssd(self, original, call: dict, where: str):
        """Mamba2's chunked scan: state [b, h, headdim, N], h_t = exp(dt A) h_{t-1} + dt x_t B_t^T,
        y_t = h_t C_t + D x_t. Widened along headdim ([x, 0_N], initial rows I_N): the extra output
        columns are the effective C's, the extra final rows exp(sum dt A) I (a scalar map per head)."""
        if call.get("initial_states") is not None or call.get("return_final_states"):
            raise UnsupportedModelError(f"ds_seqpar.hf: a recurrent state cache in {where} cannot be exact under "
                                        f"sequence parallelism; train with use_cache=False")
        x, dt, b, c = (call.pop(n) for n in ("hidden_states", "dt", "B", "C"))
        call.pop("initial_states"), call.pop("return_final_states")
        if self.sp.config.linear_strategy == "ulysses":
            return self._ssd_ulysses(original, x, dt, b, c, call, where)
        frags = self.fragments(x.shape[1], 1, where)
        p_dim, n_dim = x.shape[-1], b.shape[-1]
        pieces = []
        for _, n, off in frags[self.sp.rank]:
            sl = slice(off, off + n)
            h0 = torch.zeros(x.shape[0], x.shape[2], p_dim + n_dim, n_dim, dtype=torch.float32, device=x.device)
            h0[..., p_dim:, :] = torch.eye(n_dim, dtype=torch.float32, device=x.device)
            wide = torch.cat([x[:, sl], x.new_zeros(x.shape[:1] + (n,) + x.shape[2:3] + (n_dim,))], -1)
            out, final = original(wide, dt[:, sl], B=b[:, sl], C=c[:, sl], initial_states=h0,
                                  return_final_states=True, **call)
            pieces.append((out[..., :p_dim], out[..., p_dim:].float(), final[..., p_dim:p_dim + 1, :1],
                           final[..., :p_dim, :]))
        s_in = states_in(torch.stack([q[2] for q in pieces]), torch.stack([q[3] for q in pieces]), frags,
                         self.sp.rank, self.sp.group, self.sp.stats, self.sp.config.lasp_comm)   # [nf, b, h, P, N]
        outs = [with_state_in(y0, c_eff, s.transpose(-1, -2)) for (y0, c_eff, _, _), s in zip(pieces, s_in)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, 1)

    def _ssd_ulysses(self, original, x, dt, b, c, call, where):
        sp = self.sp
        for name, count in (("heads", x.shape[2]), ("groups", b.shape[2])):
            if count % sp.size:
                raise UnsupportedModelError(f"ds_seqpar.hf: {where} has {count} {name}, not divisible by "
                                            f"sequence_parallel.size={sp.size}: linear_strategy 'ulysses' splits "
                                            f"them over ranks; use linear_strategy 'lasp'")
        n = x.shape[1] * sp.size
        inverse, perm = sp.layout.inverse(n, x.device), sp.layout.permutation(n, x.device)
        heads = x.shape[2] // sp.size
        mine = slice(sp.rank * heads, (sp.rank + 1) * heads)      # the all-to-all hands rank r head block r

        def to_heads(t):
            return comm.all_to_all(t.contiguous(), 2, 1, sp.group, sp.stats, "linear_all_to_all").index_select(1, inverse)

        per_head = {k: (v[mine] if torch.is_tensor(v) and v.dim() == 1 and v.shape[0] == x.shape[2] else v)
                    for k, v in call.items()}                     # A, D, dt_bias: one entry per head
        out = original(to_heads(x), to_heads(dt), B=to_heads(b), C=to_heads(c), initial_states=None,
                       return_final_states=False, **per_head)
        return comm.all_to_all(out.index_select(1, perm).contiguous(), 1, 2, sp.group, sp.stats, "linear_all_to_all")

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
