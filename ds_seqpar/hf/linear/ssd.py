"""Mamba2's chunked scan (``mamba2_chunk_scan``: Bamba, Granite-4.0-H, Nemotron-H, Falcon-H1, Zamba2,
Mamba2): state [b, h, headdim, N], h_t = exp(dt A) h_{t-1} + dt x_t B_t^T, y_t = h_t C_t + D x_t. Its
transition is a data-dependent scalar per head, so no widened call is needed."""
from __future__ import annotations

import math

import torch

from .fold import fold, unused_map
from .prefill import prefill_end, wants_state


def ssd_map(original, x, dt, b, c, call: dict, enters_zero: bool = False):
    """One fragment of Mamba2's chunked scan as an affine map of its entering state [b, h, headdim, N]:
    returns (o0, C~, A, B) as delta_rule_map, A a scalar per head [b, h, 1, 1]. The plain call from the
    zero state gives o0 and B (its final state); a probe of width 1 (x = 0, B = 0, C = 1, initial
    state 1) returns each token's decay from the run's start, exp(sum_{s<=t} dt_s A) [b, l, h], through
    the op's own dt handling (bias, softplus, limits), in chunks of probe_chunk (the probe's cost is
    the chunks' decay matrices). Then C~_t = decay_t C_t (C's groups repeated to the heads) and A = the
    last token's decay. ``enters_zero``: as delta_rule_map's (no probe)."""
    o0, final = original(x, dt, B=b, C=c, initial_states=None, return_final_states=True, **call)
    heads, groups = x.shape[2], b.shape[2]
    if enters_zero:
        return o0, None, unused_map(final, 1), final.float()
    one = x.new_ones(x.shape[:2] + (groups, 1))                                      # [b, l, groups, 1]
    h0 = torch.ones(x.shape[0], heads, 1, 1, dtype=torch.float32, device=x.device)
    chunk = {"chunk_size": probe_chunk(x.shape[1])} if "chunk_size" in call else {}
    probe = original(x.new_zeros(x.shape[:3] + (1,)), dt, B=torch.zeros_like(one), C=one, initial_states=h0,
                     return_final_states=False, **dict(call, **chunk))
    decay = probe[..., 0].float()                                                    # [b, l, h]
    c_eff = decay[..., None] * c.float().repeat_interleave(heads // groups, dim=2)    # [b, l, h, N]
    return o0, c_eff, decay[:, -1, :, None, None], final.float()


def probe_chunk(n: int) -> int:
    """The SSD probe's chunk: its work is about n x chunk (the decay matrix of each chunk) plus
    (n / chunk)^2 (the decays between chunks); the power of two near the cube root of 2n balances them."""
    return max(8, 1 << math.ceil(math.log2((2 * n) ** (1 / 3))))


def ssd(mixers, original, call: dict, where: str):
    """The op under sequence parallelism: its output, or in generate's prefill (output, the state after the last
    prompt token [b, h, headdim, N] fp32, the same on every rank; prefill.py)."""
    final = wants_state(mixers, call.get("initial_states"), call.get("return_final_states"), where)
    x, dt, b, c = (call.pop(n) for n in ("hidden_states", "dt", "B", "C"))
    call.pop("initial_states"), call.pop("return_final_states")
    if mixers.exchange.heads_parallel:
        def local(x_, dt_, b_, c_, mine):              # A, D, dt_bias: one entry per head
            per_head = {k: (v[mine] if torch.is_tensor(v) and v.dim() == 1 and v.shape[0] == x.shape[2] else v)
                        for k, v in call.items()}
            return original(x_, dt_, B=b_, C=c_, initial_states=None, return_final_states=final, **per_head)
        return mixers.heads_parallel(local, (x, dt, b, c), where, with_state=final)
    frags, resets = mixers.runs(x.shape[1], 1, where)
    pieces = [ssd_map(original, x[:, off:off + n], dt[:, off:off + n], b[:, off:off + n], c[:, off:off + n], call,
                      start == 0 or start in resets) for start, n, off in frags[mixers.exchange.rank]]
    return fold(mixers.exchange, pieces, frags, resets, state_rows_are_values=True, end=prefill_end(mixers, final))


__all__ = ["ssd_map", "probe_chunk", "ssd"]
