"""The delta rule (``torch_chunk_gated_delta_rule``: gated DeltaNet in Qwen3-Next, Qwen3.5, OLMo-Hybrid;
``chunk_kimi_delta_attention``: Kimi-Linear, Ling bailing_hybrid; one signature): its transition is a
K x K matrix, which one call of the op on a widened problem returns."""
from __future__ import annotations

import torch

from .fold import fold, unused_map
from .prefill import prefill_end, wants_state


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
        return out, None, unused_map(final, dk), final.float()
    h0 = torch.zeros(v.shape[0], v.shape[2], dk, dv + dk, dtype=torch.float32, device=v.device)
    h0[..., dv:] = torch.eye(dk, dtype=torch.float32, device=v.device)
    wide = torch.cat([v, v.new_zeros(v.shape[:-1] + (dk,))], -1)
    out, final = original(q, k, wide, g=g, beta=beta, initial_state=h0, output_final_state=True, **call)
    return out[..., :dv], out[..., dv:].float(), final[..., dv:], final[..., :dv]


def delta_rule(mixers, original, call: dict, where: str):
    """The op under sequence parallelism: (out, None), or in generate's prefill (out, the state after the
    last prompt token [b, h, dk, dv] fp32, the same on every rank; prefill.py)."""
    final = wants_state(mixers, call.get("initial_state"), call.get("output_final_state"), where)
    q, k, v, g, beta = (call.pop(n) for n in ("query", "key", "value", "g", "beta"))
    call.pop("initial_state"), call.pop("output_final_state")
    if mixers.exchange.heads_parallel:
        def local(q_, k_, v_, g_, beta_, mine):
            out, state = original(q_, k_, v_, g=g_, beta=beta_, initial_state=None, output_final_state=final,
                                  **call)
            return (out, state) if final else out
        got = mixers.heads_parallel(local, (q, k, v, g, beta), where, with_state=final)
        return got if final else (got, None)
    frags, resets = mixers.runs(q.shape[1], 1, where)
    pieces = [delta_rule_map(original, q[:, off:off + n], k[:, off:off + n], v[:, off:off + n], g[:, off:off + n],
                             beta[:, off:off + n], call, start == 0 or start in resets)
              for start, n, off in frags[mixers.exchange.rank]]
    got = fold(mixers.exchange, pieces, frags, resets, end=prefill_end(mixers, final))
    return got if final else (got, None)


__all__ = ["delta_rule_map", "delta_rule"]
