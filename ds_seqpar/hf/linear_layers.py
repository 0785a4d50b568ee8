"""Linear-attention, SSM and convolution layers of Hugging Face hybrids under sequence parallelism
(docs/hybrids.md).

transformers has no registry for these layers, but the ones we support call module-level ops that
Python resolves at call time: ``causal_conv1d_fn`` (every short causal conv),
``torch_chunk_gated_delta_rule`` (gated DeltaNet: Qwen3-Next, Qwen3.5, OLMo-Hybrid),
``chunk_kimi_delta_attention`` (Kimi delta attention: Kimi-Linear, Ling bailing_hybrid) and
``mamba2_chunk_scan`` (Mamba2 SSD: Bamba, Granite-4.0-H, Nemotron-H, Falcon-H1, Zamba2, Mamba2). The
modeling file's global is replaced by a seam that calls the original unless an applied layer is
running (a forward pre-hook on each such layer says so), so other models in the process, and the
layer after remove_sequence_parallel, run transformers' code untouched. MiniMax's lightning
attention has no op (an inline loop): its forward is replaced on the instance, keeping
transformers' projections, norm and gate. Only the sequence-mixing op and the conv become
sequence-parallel:

  * conv: each run of consecutive global tokens a rank holds is convolved with the K-1 inputs
    before it (state_passing.halos), and the first K-1 outputs dropped;
  * ``linear_strategy: lasp``: one call of the original op on the widened problem (delta rule:
    values [v, 0_K], initial state [0, I_K]) returns, by linearity, the zero-init output o0, the
    effective queries Q~ and the run's map (A, B) in the final state (SSD, whose transition is a
    scalar per head: the plain call and a width-1 probe of the decays, ssd_map);
    state_passing.states_in folds the maps in global order (allgather or ring); then
    o = o0 + Q~ . S_in. Autograd gives the backward (the maps' all-gather has a reduce-scatter dual);
  * ``linear_strategy: ulysses``: all-to-all to whole sequences of a P-th of the heads, the
    original op, all-to-all back (heads and groups must divide by P).
Packed documents (batch 1): runs are cut at document starts, where state and halo restart.

Every seam call is counted per layer; a layer that bypassed a seam (another kernel swapped in, a
fused path) is refused after its forward, before the loss and backward.
"""
from __future__ import annotations

import functools
import inspect
import math
import sys
from typing import Dict, List, Tuple

import torch
import torch.nn as nn

from .. import comm
from ..kernels.linear import linear_attention
from ..strategies.state_passing import check_fragments, cut_at_documents, fragments, halos, states_in
from ..errors import UnsupportedModelError

CONV = "causal_conv1d_fn"
SSD = "mamba2_chunk_scan"
FUSED = "mamba2_split_conv1d_scan_combined"     # mamba_ssm's whole-layer kernel: no state input, switched off
OPTIONAL = frozenset({FUSED})                   # called in training only
_GDN = (CONV, "torch_chunk_gated_delta_rule")
_KDA = (CONV, "chunk_kimi_delta_attention")
_MAMBA2 = (FUSED, CONV, SSD)
LIGHTNING = "lightning"                         # MiniMax: an inline loop, no op to hook: the forward is replaced
# layer class -> the module-level ops its training forward calls, each exactly once
LAYER_OPS: Dict[str, Tuple[str, ...]] = {
    "Qwen3NextGatedDeltaNet": _GDN, "Qwen3_5GatedDeltaNet": _GDN, "Qwen3_5MoeGatedDeltaNet": _GDN,
    "OlmoHybridGatedDeltaNet": _GDN,
    "KimiLinearDeltaAttention": _KDA, "BailingHybridDeltaAttention": _KDA,
    "Lfm2ShortConv": (CONV,), "Lfm2MoeShortConv": (CONV,), "Lfm3ShortConv": (CONV,),
    "Mamba2Mixer": _MAMBA2, "BambaMixer": _MAMBA2, "GraniteMoeHybridMambaLayer": _MAMBA2,
    "NemotronHMamba2Mixer": _MAMBA2, "FalconH1Mixer": _MAMBA2, "Zamba2MambaMixer": _MAMBA2,
    "MiniMaxLightningAttention": (LIGHTNING,),
}
# model types whose every linear layer type is one of the adapted classes above (tests/dist/test_hf_zoo.py
# sweeps them): config-only checks (the main job's, before any process starts) let their linear
# layer types through; apply_sequence_parallel still verifies the modules (checks.check_modules)
HYBRID_MODEL_TYPES = frozenset({
    "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "olmo_hybrid", "kimi_linear",
    "bailing_hybrid", "lfm2", "lfm2_moe", "lfm3", "bamba", "granitemoehybrid", "nemotron_h", "falcon_h1", "zamba2",
    "mamba2", "minimax"})
# layer types that hold an adapted mixer (checks.check_modules verifies each does); "hybrid":
# Falcon-H1's attention and Mamba2 side by side
LINEAR_LAYER_TYPES = ("linear_attention", "conv", "mamba", "hybrid")

_PACKING_KWARGS = frozenset({"cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"})
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
        for name_ in ("cu_seqlens", "seq_idx"):     # packed documents: the mixers cut at them themselves
            call.pop(name_, None)
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
            if name == LIGHTNING:
                continue
            fn = getattr(module, name, None)
            if fn is None:
                raise UnsupportedModelError(f"ds_seqpar.hf: {type(m).__name__}'s modeling file has no {name}: this "
                                            f"transformers version calls another op; the layer cannot be made "
                                            f"sequence-parallel")
            if not hasattr(fn, "_ds_seqpar_original"):
                setattr(module, name, _seam(name, fn))


def delta_rule_map(original, q, k, v, g, beta, call: dict, enters_zero: bool = False):
    """One fragment of a delta-rule op as an affine map of its entering state, from one call of the
    op on the widened problem (values [v, 0_dk], initial state [0, I_dk]): returns (o0, Q~, A, B)
    with o0 the zero-state output [b, l, h, dv], Q~ the effective queries [b, l, h, dk] (fp32),
    and the final state = A . S_in + B, A [b, h, dk, dk], B [b, h, dk, dv] (fp32).
    ``enters_zero``: the fragment starts the sequence or a document, so S_in = 0 and neither Q~ nor A
    is ever used: the plain call gives o0 and B (Q~ None, A zeros: the fold multiplies it by 0)."""
    dk, dv = q.shape[-1], v.shape[-1]
    if enters_zero:
        out, final = original(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=True, **call)
        return out, None, _unused_map(final, dk), final.float()
    h0 = torch.zeros(v.shape[0], v.shape[2], dk, dv + dk, dtype=torch.float32, device=v.device)
    h0[..., dv:] = torch.eye(dk, dtype=torch.float32, device=v.device)
    wide = torch.cat([v, v.new_zeros(v.shape[:-1] + (dk,))], -1)
    out, final = original(q, k, wide, g=g, beta=beta, initial_state=h0, output_final_state=True, **call)
    return out[..., :dv], out[..., dv:].float(), final[..., dv:], final[..., :dv]


def ssd_map(original, x, dt, b, c, call: dict, enters_zero: bool = False):
    """One fragment of Mamba2's chunked scan as an affine map of its entering state [b, h, headdim, N]:
    returns (o0, C~, A, B) as delta_rule_map, A a scalar per head [b, h, 1, 1]. The transition is
    scalar, so no widened call is needed: the plain call from the zero state gives o0 and B (its
    final state); a probe of width 1 (x = 0, B = 0, C = 1, initial state 1) returns each token's decay
    from the run's start, exp(sum_{s<=t} dt_s A) [b, l, h], through the op's own dt handling (bias,
    softplus, limits), in chunks of probe_chunk (the probe's cost is the chunks' decay matrices). Then
    C~_t = decay_t C_t (C's groups repeated to the heads) and A = the last token's decay.
    ``enters_zero``: as delta_rule_map's (no probe)."""
    o0, final = original(x, dt, B=b, C=c, initial_states=None, return_final_states=True, **call)
    heads, groups = x.shape[2], b.shape[2]
    if enters_zero:
        return o0, None, _unused_map(final, 1), final.float()
    one = x.new_ones(x.shape[:2] + (groups, 1))                                      # [b, l, groups, 1]
    h0 = torch.ones(x.shape[0], heads, 1, 1, dtype=torch.float32, device=x.device)
    chunk = {"chunk_size": probe_chunk(x.shape[1])} if "chunk_size" in call else {}
    probe = original(x.new_zeros(x.shape[:3] + (1,)), dt, B=torch.zeros_like(one), C=one, initial_states=h0,
                     return_final_states=False, **dict(call, **chunk))
    decay = probe[..., 0].float()                                                    # [b, l, h]
    c_eff = decay[..., None] * c.float().repeat_interleave(heads // groups, dim=2)    # [b, l, h, N]
    return o0, c_eff, decay[:, -1, :, None, None], final.float()


def _unused_map(final, k: int):
    """Zeros [b, h, k, k] in the graph of ``final`` (zero gradient): every rank's gathered maps then
    require a gradient alike, so every rank runs the all-gather's backward collective."""
    return (final.float()[..., :1, :1] * 0).expand(*final.shape[:-2], k, k)


def probe_chunk(n: int) -> int:
    """The SSD probe's chunk: its work is about n x chunk (the decay matrix of each chunk) plus
    (n / chunk)^2 (the decays between chunks); the power of two near the cube root of 2n balances them."""
    return max(8, 1 << math.ceil(math.log2((2 * n) ** (1 / 3))))


def with_state_in(o0, q_eff, s_in):
    """o = o0 + Q~ . S_in, in o0's dtype. Q~ None: a fragment that enters with the zero state; its
    output still depends on S_in (times 0), so every rank runs the exchange's backward collectives."""
    if q_eff is None:
        return o0 + (s_in.reshape(-1)[:1].sum() * 0).to(o0.dtype)
    return (o0.float() + torch.einsum("blhk,bhkv->blhv", q_eff, s_in.float())).to(o0.dtype)


class LinearMixers:
    """The sequence-parallel ops for one applied (sp, model) pair."""

    def __init__(self, sp, layers):
        self.sp = sp
        self.names = {id(m): f"{n} ({type(m).__name__})" for n, m in layers}
        self._frags = {}
        self.documents = None        # this forward's packed-document bounds (global cu_seqlens), set by the pre-hook

    def where(self, module) -> str:
        return self.names.get(id(module), type(module).__name__)

    def hooks(self, layers) -> list:
        def pre(module, args, kwargs):
            _ACTIVE.append([self, module, {}])
            # the documents reach the mixers through self.documents; transformers' layers would pass
            # the call's cu_seqlens on to ops that refuse them (or pass them twice)
            return args, {k: v for k, v in kwargs.items() if k not in _PACKING_KWARGS}

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
            if LIGHTNING in LAYER_OPS[type(m).__name__]:
                handles.append(_InstanceForward(m, functools.partial(_lightning_forward, self, m)))
            handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(m.register_forward_hook(post, with_kwargs=True, always_call=True))
        return handles

    def lightning(self, q, k, v, decay_h, where: str):
        """Causal linear attention with a fixed decay per head (MiniMax): per fragment, the single-
        process kernel from a zero state, and the scalar map (lambda^n, sum_s lambda^(n-1-s) k_s v_s^T)
        folded like the others; the effective query of token t is lambda^(t+1) q_t."""
        if self.sp.config.linear_strategy == "ulysses":
            return self._heads_parallel(lambda q_, k_, v_, mine: linear_attention(q_, k_, v_, decay_h[mine].to(q.dtype)),
                                        (q, k, v), where)
        frags, resets = self.fragments(q.shape[1], 1, where)
        pieces = []
        for _, n, off in frags[self.sp.rank]:
            qf, kf, vf = (t[:, off:off + n] for t in (q, k, v))
            steps = torch.arange(n, device=q.device, dtype=torch.float32)
            lam = decay_h.float()[:, None]                                           # [h, 1]
            o0 = linear_attention(qf, kf, vf, decay_h.to(q.dtype))
            q_eff = qf.float() * (lam ** (steps + 1)).t()[None, :, :, None]          # [b, n, h, d]
            b_map = torch.einsum("bshk,bshv->bhkv", kf.float() * (lam ** (n - 1 - steps)).t()[None, :, :, None],
                                 vf.float())
            a_map = (lam[:, 0] ** n).expand(q.shape[0], -1)[..., None, None]          # [b, h, 1, 1]
            pieces.append((o0, q_eff, a_map, b_map))
        return self._fold(pieces, frags, resets)

    def _fold(self, pieces, frags, resets, state_rows_are_values: bool = False):
        """pieces: per local fragment (o0, effective queries, A, B); the states entering the fragments
        (state_passing.states_in), each fragment's output corrected with its state, in local order.
        ``state_rows_are_values``: Mamba2 keeps the state as [headdim (values), N (keys)]."""
        s_in = states_in(torch.stack([p[2] for p in pieces]), torch.stack([p[3] for p in pieces]), frags,
                         self.sp.rank, self.sp.group, self.sp.stats, self.sp.config.lasp_comm, resets)
        outs = [with_state_in(o0, q_eff, s.transpose(-1, -2) if state_rows_are_values else s)
                for (o0, q_eff, _, _), s in zip(pieces, s_in)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, 1)

    def fragments(self, local_len: int, width: int, where: str):
        """(runs of this forward: the layout's runs of consecutive tokens, cut at packed-document
        starts; the global positions where a document starts, where state and halo restart)."""
        n = local_len * self.sp.size
        if n not in self._frags:                 # the layout's runs, per length (documents change per batch)
            self._frags[n] = fragments(self.sp.layout, n)
        frags = self._frags[n]
        check_fragments(frags, width, where)
        if self.documents is None:
            return frags, frozenset()
        docs = [int(b) for b in self.documents]
        return cut_at_documents(frags, docs), frozenset(b for b in docs if 0 < b < n)

    # -- the ops -------------------------------------------------------------------------------

    def conv(self, original, call: dict):
        x = call.pop("hidden_states")                            # [b, channels, local tokens]
        width = call["weight"].shape[-1] - 1
        if width == 0:
            return original(x, **call)
        frags, resets = self.fragments(x.shape[-1], width, f"a causal conv1d of kernel {width + 1}")
        before = halos(x, width, frags, self.sp.rank, self.sp.group, self.sp.stats, resets)
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
        frags, resets = self.fragments(q.shape[1], 1, where)
        pieces = [delta_rule_map(original, q[:, off:off + n], k[:, off:off + n], v[:, off:off + n], g[:, off:off + n],
                                 beta[:, off:off + n], call, start == 0 or start in resets)
                  for start, n, off in frags[self.sp.rank]]
        return self._fold(pieces, frags, resets), None

    def ssd(self, original, call: dict, where: str):
        """Mamba2's chunked scan: state [b, h, headdim, N], h_t = exp(dt A) h_{t-1} + dt x_t B_t^T,
        y_t = h_t C_t + D x_t; each fragment's map from ssd_map (no widening: the transition is a
        scalar per head)."""
        if call.get("initial_states") is not None or call.get("return_final_states"):
            raise UnsupportedModelError(f"ds_seqpar.hf: a recurrent state cache in {where} cannot be exact under "
                                        f"sequence parallelism; train with use_cache=False")
        x, dt, b, c = (call.pop(n) for n in ("hidden_states", "dt", "B", "C"))
        call.pop("initial_states"), call.pop("return_final_states")
        if self.sp.config.linear_strategy == "ulysses":
            return self._ssd_ulysses(original, x, dt, b, c, call, where)
        frags, resets = self.fragments(x.shape[1], 1, where)
        pieces = [ssd_map(original, x[:, off:off + n], dt[:, off:off + n], b[:, off:off + n], c[:, off:off + n], call,
                          start == 0 or start in resets) for start, n, off in frags[self.sp.rank]]
        return self._fold(pieces, frags, resets, state_rows_are_values=True)

    def _heads_parallel(self, local, tensors, where: str):
        """linear_strategy ulysses for a mixer whose tensors all have the heads on dim 2: all-to-all
        to whole sequences (global order) of this rank's head block, ``local(*tensors, heads slice)``,
        and back."""
        sp = self.sp
        for t in tensors:
            if t.shape[2] % sp.size:
                raise UnsupportedModelError(f"ds_seqpar.hf: {where} has {t.shape[2]} heads (or groups) in one of its "
                                            f"inputs, not divisible by sequence_parallel.size={sp.size}: "
                                            f"linear_strategy 'ulysses' splits them over ranks; use linear_strategy "
                                            f"'lasp'")
        heads = tensors[0].shape[2]
        n = tensors[0].shape[1] * sp.size
        inverse, perm = sp.layout.inverse(n, tensors[0].device), sp.layout.permutation(n, tensors[0].device)
        mine = slice(sp.rank * (heads // sp.size), (sp.rank + 1) * (heads // sp.size))
        whole = [comm.all_to_all(t.contiguous(), 2, 1, sp.group, sp.stats, "linear_all_to_all").index_select(1, inverse)
                 for t in tensors]
        if self.documents is None:
            out = local(*whole, mine)
        else:                          # packed: each document from the zero state, whole on this rank
            docs = [int(d) for d in self.documents]
            out = torch.cat([local(*(t[:, a:b] for t in whole), mine) for a, b in zip(docs[:-1], docs[1:])], 1)
        return comm.all_to_all(out.index_select(1, perm).contiguous(), 1, 2, sp.group, sp.stats, "linear_all_to_all")

    def _ssd_ulysses(self, original, x, dt, b, c, call, where):
        def local(x_, dt_, b_, c_, mine):              # A, D, dt_bias: one entry per head
            per_head = {k: (v[mine] if torch.is_tensor(v) and v.dim() == 1 and v.shape[0] == x.shape[2] else v)
                        for k, v in call.items()}
            return original(x_, dt_, B=b_, C=c_, initial_states=None, return_final_states=False, **per_head)
        return self._heads_parallel(local, (x, dt, b, c), where)

    def _delta_ulysses(self, original, q, k, v, g, beta, call, where):
        def local(q_, k_, v_, g_, beta_, mine):
            return original(q_, k_, v_, g=g_, beta=beta_, initial_state=None, output_final_state=False, **call)[0]
        return self._heads_parallel(local, (q, k, v, g, beta), where)


class _InstanceForward:
    """A replaced ``forward`` on one module instance; ``remove()`` restores the class's."""

    def __init__(self, module, forward):
        self.module = module
        module.forward = forward

    def remove(self) -> None:
        self.module.__dict__.pop("forward", None)


def _lightning_forward(mixers, module, hidden_states, position_embeddings=None, attention_mask=None,
                       past_key_values=None, **kwargs):
    """transformers' MiniMaxLightningAttention.forward (training path: no cache) with its block loop
    replaced by the sequence-parallel lightning attention; projections, norm and gate unchanged."""
    where = mixers.where(module)
    if past_key_values is not None:
        raise UnsupportedModelError(f"ds_seqpar.hf: a linear-attention cache in {where} cannot be exact under "
                                    f"sequence parallelism; train with use_cache=False")
    _ACTIVE[-1][2][LIGHTNING] = _ACTIVE[-1][2].get(LIGHTNING, 0) + 1
    b, n, _ = hidden_states.shape
    heads, d = module.num_attention_heads, module.head_dim
    qkv = module.act_fn(module.qkv_proj(hidden_states)).reshape(b, n, heads, 3 * d)
    q, k, v = torch.split(qkv, d, dim=3)
    out = mixers.lightning(q, k, v, torch.exp(-module.slope_rate.reshape(heads)), where)
    out = module.norm(out.reshape(b, n, heads * d))
    out = torch.sigmoid(module.output_gate(hidden_states)) * out
    return module.out_proj(out), None


__all__ = ["LAYER_OPS", "LINEAR_LAYER_TYPES", "HYBRID_MODEL_TYPES", "LinearMixers", "install_seams", "linear_modules", "delta_rule_map",
           "ssd_map", "with_state_in"]
