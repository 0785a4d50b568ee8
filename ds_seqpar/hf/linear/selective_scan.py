"""Mamba-1's selective scan (``mamba_selective_scan``: Mamba, Falcon-Mamba, Jamba, Zamba). Per channel c
a state h_c [N]: h_t = exp(dt_t A_c) * h_{t-1} + dt_t B_t x_t (A [channels, N]: a diagonal decay),
y_t = h_t . C_t + D x_t, times silu(z_t). transformers' op takes no initial state, so the entering
state comes in by composition: the op from zero gives o0 and B (its final state), and by linearity

    o_t = o0_t + silu(z_t) sum_n exp(A_cn sum_{s<=t} dt_s) C_tn S_in[c, n]

The transition is the diagonal exp(A sum_t dt_t) [b, channels, N], as large as the state. Layouts: the
op's tensors are channels-first [b, channels, l] (B, C: [b, N, l]); the fold's are [b, l, channels, N]
(effective queries) and [b, channels, N, 1] (the state, one value column)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .fold import fold
from .prefill import prefill_end, wants_state

_TOKENWISE = ("z",)             # op arguments that carry a token axis besides the five popped ones


def steps(dt, call: dict):
    """dt_t as the op discretises it: plus delta_bias per channel, then softplus if asked (fp32)."""
    dt = dt.float()
    if call.get("delta_bias") is not None:
        dt = dt + call["delta_bias"].float()[..., None]
    return F.softplus(dt) if call.get("delta_softplus") else dt


def scan_map(original, u, dt, a, b, c, call: dict, enters_zero: bool = False):
    """One fragment of the selective scan as an affine map of its entering state [b, channels, N, 1]:
    (o0 [b, l, channels, 1], C~ [b, l, channels, N] fp32 (silu(z) folded in), A [b, channels, N, 1],
    B [b, channels, N, 1]). ``enters_zero``: the fragment starts the sequence or a document (C~ None,
    A never applied)."""
    o0, final = original(u, dt, a, b, c, return_last_state=True, **call)
    o0_blc1 = o0.transpose(1, 2)[..., None]
    b_map = final.float()[..., None]                                              # [b, channels, N, 1]
    if enters_zero:
        return o0_blc1, None, b_map * 0, b_map
    decay = torch.exp(a.float()[None, :, None, :] * steps(dt, call).cumsum(-1)[..., None])   # [b, ch, l, N]
    c_eff = decay * c.float().transpose(1, 2)[:, None]                                     # C_t per channel
    if call.get("z") is not None:
        c_eff = c_eff * F.silu(call["z"].float())[..., None]
    return o0_blc1, c_eff.transpose(1, 2), decay[:, :, -1, :, None], b_map


def selective_scan(mixers, original, call: dict, where: str):
    """The op under sequence parallelism: its output, or in generate's prefill (output, the state after the last
    prompt token [b, channels, N] fp32, the same on every rank; prefill.py)."""
    final = wants_state(mixers, None, call.get("return_last_state"), where, " (Mamba-1 selective scan)")
    u, dt, a, b, c = (call.pop(n) for n in ("hidden_states", "dt", "A", "B", "C"))
    call.pop("return_last_state")
    if mixers.exchange.heads_parallel:
        return _channels_parallel(mixers, original, u, dt, a, b, c, call, where, final)
    frags, resets = mixers.runs(u.shape[-1], 1, where)

    def part(off, n):
        return dict(call, **{k: call[k][..., off:off + n] for k in _TOKENWISE if call.get(k) is not None})
    pieces = [scan_map(original, u[..., off:off + n], dt[..., off:off + n], a, b[..., off:off + n],
                       c[..., off:off + n], part(off, n), start == 0 or start in resets)
              for start, n, off in frags[mixers.exchange.rank]]
    got = fold(mixers.exchange, pieces, frags, resets, end=prefill_end(mixers, final))
    if not final:
        return got[..., 0].transpose(1, 2)
    return got[0][..., 0].transpose(1, 2), got[1][..., 0]


def _channels_parallel(mixers, original, u, dt, a, b, c, call, where, final=False):
    """linear_strategy ulysses: the channels are independent scans, so each rank takes a P-th of them
    over the whole sequence; B and C (one group, shared by every channel) go to every rank."""
    z = call.pop("z", None)
    per_channel = [t.transpose(1, 2) for t in (u, dt) + ((z,) if z is not None else ())]     # [b, l, channels]
    shared = [t.transpose(1, 2)[:, :, None] for t in (b, c)]                                 # [b, l, 1, N]
    channels = u.shape[1]

    def local(*tensors):
        *ts, mine = tensors
        u_, dt_, *rest = (t.transpose(1, 2) for t in ts[:len(per_channel)])
        b_, c_ = (t[:, :, 0].transpose(1, 2) for t in ts[len(per_channel):])
        mine_call = {k: (v[mine] if torch.is_tensor(v) and v.shape[:1] == (channels,) else v) for k, v in call.items()}
        if rest:
            mine_call["z"] = rest[0]
        out = original(u_, dt_, a[mine], b_, c_, return_last_state=final, **mine_call)
        if final:                                                    # and the state [b, channels / P, N]
            return out[0].transpose(1, 2), out[1]
        return out.transpose(1, 2)                                                           # [b, l, channels / P]
    got = mixers.heads_parallel(local, per_channel + shared, where, "channels", with_state=final)
    return (got[0].transpose(1, 2), got[1]) if final else got.transpose(1, 2)


__all__ = ["scan_map", "selective_scan", "steps"]
