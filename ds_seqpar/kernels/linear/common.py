"""What the chunked linear-attention forward and backward share: input checks, decay tables, the
chunked block layout, and the scans that carry a state (or its gradient) across the chunks.

Legend (names carry layout; forward.py states the maths):
    q_bshd        [B, S, H, Dk]          queries of this block (S local tokens)
    k_bshd        [B, S, Hkv, Dk]        keys; q head h reads kv head h // G, G = H // Hkv (v_bshd alike)
    decay_h       [H]                    per-q-head lambda in (0, 1], or None (= 1); never learned
    x_bnchd       [B, N, C, H, D]        a view of x_bshd in N chunks of C tokens (front-padded if needed)
    x_mcd         [B*N, C, D]            one head's chunks: a strided view, the batch of every bmm
    kv_zbnkv      [Z, B, N, Dk, Dv]      each chunk's own decayed k^T v (fp32); Z state heads: H with
                                         decay (each q head decays its own state), Hkv without (a kv
                                         group shares it), H again once per-q-head state_in is folded in
    st_zbnkv      [Z, B, N, Dk, Dv]      state before each chunk (dh_zbnkv: gradient reaching it)
    state_bhkv    [B, H, Dk, Dv]         a block's state, the contract with the LASP strategy;
                                         fp32 (fp64 for fp64 inputs), even for bf16 inputs
Padding goes at the FRONT of chunk 0 (zero keys and values add nothing to any state, and all decays
are relative). A state_in enters at padded position `pad`, so chunk 0 reads it with its own row
weights (q_in0) and carries it across chunk 0 with lambda^(C-pad) (step0): nothing is ever divided
by a power of lambda, which may be tiny.
"""
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..base import check_head_groups


# ----------------------------------------------------------------------------- checks and decay tables
def state_dtype(dtype: torch.dtype) -> torch.dtype:
    # States sum many outer products: fp32 even for bf16/fp16 inputs; fp64 stays fp64 for tests.
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_inputs(q_bshd: Tensor, k_bshd: Tensor, v_bshd: Tensor, decay_h: Optional[Tensor]) -> None:
    """ValueError for bad shapes, dtypes or decay; LASP calls it before any communication."""
    if q_bshd.dim() != 4 or k_bshd.dim() != 4 or v_bshd.dim() != 4:
        raise ValueError(f"linear attention wants q, k, v as [batch, seq, heads, dim]; got shapes "
                         f"{tuple(q_bshd.shape)}, {tuple(k_bshd.shape)}, {tuple(v_bshd.shape)}")
    b, s, h, dk = q_bshd.shape
    if k_bshd.shape[:2] != (b, s) or k_bshd.shape[3] != dk or v_bshd.shape[:3] != k_bshd.shape[:3]:
        raise ValueError(f"linear attention: k must be [{b}, {s}, kv_heads, {dk}] and v [{b}, {s}, kv_heads, dv];"
                         f" got k {tuple(k_bshd.shape)}, v {tuple(v_bshd.shape)}")
    check_head_groups(h, k_bshd.shape[2], "linear attention: ")
    if not (q_bshd.dtype == k_bshd.dtype == v_bshd.dtype) or not q_bshd.is_floating_point():
        raise ValueError(f"linear attention: q, k, v must share one floating dtype; got "
                         f"{q_bshd.dtype}, {k_bshd.dtype}, {v_bshd.dtype}")
    if decay_h is None:
        return
    if decay_h.shape != (h,) or not decay_h.is_floating_point():
        raise ValueError(f"linear attention: decay must be a float tensor of shape [{h}] (one per q head); "
                         f"got {decay_h.dtype} {tuple(decay_h.shape)}")
    if decay_h.requires_grad:
        raise ValueError("linear attention: decay is a fixed input and gets no gradient; pass decay.detach()")
    if bool((decay_h <= 0).any()) or bool((decay_h > 1).any()):
        raise ValueError(f"linear attention: decay values must lie in (0, 1]; got {decay_h.tolist()}")


def powers(decay_h: Tensor, exponents: Tensor, dtype: torch.dtype) -> Tensor:
    """lambda_h^e as [H, len(e), 1] in dtype, via exp(e log lambda) in fp32/fp64 (e >= 0: no overflow).
    Powers below dtype's smallest normal number are exactly 0 (flush to zero): state terms reach
    lambda^S over a whole block, and denormal multipliers make CPU matmuls and products several
    times slower, while what they weight is negligible beside the weight-1 terms of the same sums."""
    log_h1 = decay_h.to(exponents.device, state_dtype(dtype)).log().view(-1, 1)   # [H, 1]
    pw_he = torch.exp(exponents.to(log_h1.dtype) * log_h1).to(dtype)
    return pw_he.masked_fill(pw_he < torch.finfo(dtype).tiny, 0).unsqueeze(-1)


def position_decay(decay_h: Tensor, like_bshd: Tensor, offset: int) -> Tensor:
    """lambda^(t+offset) for t = 0..S-1 as [H, S, 1], on like's device and in like's dtype."""
    pos = torch.arange(offset, like_bshd.shape[1] + offset, device=like_bshd.device)
    return powers(decay_h, pos, like_bshd.dtype)


def state_decay(decay_h: Optional[Tensor], length: int, dtype=torch.float32) -> Optional[Tensor]:
    """lambda^length per q head as [H, 1, 1] (None without decay): carries a state across a block."""
    if decay_h is None:
        return None
    return torch.exp(length * decay_h.to(dtype).log()).view(-1, 1, 1)


# ----------------------------------------------------------------------------- the chunked block
class Block(NamedTuple):
    q: Tensor                # q_bnchd (front-padded so that N*C = S + pad)
    k: Tensor                # k_bnchd
    v: Tensor                # v_bnchd
    pad: int
    kv_heads: int
    state_heads: int         # Hs: H with decay, Hkv without (a state_in may promote it to H)
    decay_h: Optional[Tensor]
    mask: Tensor             # [H, C, C] causal mask * lambda^(i-j) (expanded view without decay)
    q_in: Optional[Tensor]   # [H, C, 1] lambda^(i+1): state before the chunk -> query i
    q_in0: Optional[Tensor]  # [H, C, 1] lambda^(i+1-pad), 0 on padded rows: state_in -> chunk 0 (pad > 0)
    k_out: Optional[Tensor]  # [H, C, 1] lambda^(C-1-j): key j -> state after the chunk
    step: Optional[Tensor]   # [H, 1, 1, 1] lambda^C: state before -> after one chunk (state dtype)
    step0: Optional[Tensor]  # [H, 1, 1, 1] lambda^(C-pad): state_in -> state after chunk 0


def chunked(x_bshd: Tensor, chunk: int) -> Tuple[Tensor, int]:
    """x_bshd -> (x_bnchd, pad), zero padding at the front (see the module doc)."""
    b, s, h, d = x_bshd.shape
    n = -(-s // chunk)
    pad = n * chunk - s
    if pad:
        x_bshd = F.pad(x_bshd, (0, 0, 0, 0, pad, 0))
    return x_bshd.reshape(b, n, chunk, h, d), pad                     # a view for contiguous inputs


def head_slice(x_bnchd: Tensor, h: int) -> Tensor:
    b, n, c, _, d = x_bnchd.shape
    return x_bnchd[:, :, :, h].reshape(b * n, c, d)      # x_mcd: a view for contiguous inputs


def prepare_block(q_bshd, k_bshd, v_bshd, decay_h, chunk_size) -> Block:
    check_inputs(q_bshd, k_bshd, v_bshd, decay_h)
    if chunk_size < 1:
        raise ValueError(f"linear attention: chunk_size must be >= 1; got {chunk_size}")
    h, hkv = q_bshd.shape[2], k_bshd.shape[2]
    c = min(chunk_size, q_bshd.shape[1])
    (q, pad), (k, _), (v, _) = (chunked(x, c) for x in (q_bshd, k_bshd, v_bshd))
    pos = torch.arange(c, device=q_bshd.device)
    causal = (pos[:, None] >= pos[None, :]).to(q_bshd.dtype)
    if decay_h is None:
        return Block(q, k, v, pad, hkv, hkv, None, causal.expand(h, c, c), None, None, None, None, None)
    # exponent i-j clamped at 0 above the diagonal: those entries are masked, and must not overflow
    age = (pos[:, None] - pos[None, :]).clamp(min=0).flatten()
    mask = powers(decay_h, age, q_bshd.dtype).view(h, c, c) * causal
    sdt = state_dtype(q_bshd.dtype)
    step, step0 = (powers(decay_h, torch.tensor([e], device=pos.device), sdt).view(h, 1, 1, 1) for e in (c, c - pad))
    q_in0 = None if not pad else \
        powers(decay_h, (pos + 1 - pad).clamp(min=0), q_bshd.dtype) * (pos >= pad).to(q_bshd.dtype).view(c, 1)
    return Block(q, k, v, pad, hkv, h, decay_h, mask, powers(decay_h, pos + 1, q_bshd.dtype), q_in0,
                  powers(decay_h, c - 1 - pos, q_bshd.dtype), step, step0)


def row_weighted(blk: Block, x_mcd: Tensor, x_bnchd: Tensor, qh: int, with_state_in: bool) -> Tensor:
    """x * lambda^(i+1) per row (q in forward, do in backward): what reads (or feeds) the state before
    each chunk. Chunk 0 reads a state_in with its own weights; without one its state is 0 anyway."""
    if blk.q_in is None:
        return x_mcd
    x_w = x_mcd * blk.q_in[qh]
    if with_state_in and blk.q_in0 is not None:
        b, n, c, _, d = x_bnchd.shape
        x_w.view(b, n, c, d)[:, 0] = x_bnchd[:, 0, :, qh] * blk.q_in0[qh]
    return x_w


# ----------------------------------------------------------------------------- states across the chunks
def bmm_acc(out: Tensor, a: Tensor, b: Tensor, first: bool) -> None:
    """out = a @ b (first) or out += a @ b; out may be a wider (state) dtype than a and b. Writing
    the first term instead of zero-filling saves a pass over memory (beta=0 ignores out's garbage)."""
    if out.dtype == a.dtype:
        out.baddbmm_(a, b, beta=0.0 if first else 1.0)
    elif first:
        out.copy_(torch.bmm(a, b))
    else:
        out.add_(torch.bmm(a, b))


def kv_of_state(blk: Block, hs: int) -> int:
    return hs // (blk.state_heads // blk.kv_heads)


def chunk_products(blk: Block) -> Tensor:
    """kv_zbnkv: each chunk's own sum_j lambda^(C-1-j) k_j^T v_j, per state head."""
    b, n, c, _, dk = blk.k.shape
    dv = blk.v.shape[-1]
    kv = torch.empty(blk.state_heads, b, n, dk, dv, dtype=state_dtype(blk.k.dtype), device=blk.k.device)
    for hs in range(blk.state_heads):
        k_mcd = head_slice(blk.k, kv_of_state(blk, hs))
        k_mcd = k_mcd if blk.k_out is None else k_mcd * blk.k_out[hs]
        bmm_acc(kv[hs].view(b * n, dk, dv), k_mcd.transpose(1, 2), head_slice(blk.v, kv_of_state(blk, hs)), True)
    return kv


def per_q_head(x_zbnkv: Tensor, heads: int) -> Tensor:
    """Kv-group states -> one per q head (no decay, GQA), so a per-q-head state_in can join them."""
    return x_zbnkv if x_zbnkv.shape[0] == heads else x_zbnkv.repeat_interleave(heads // x_zbnkv.shape[0], 0)


def scan_states(blk: Block, kv: Tensor, init_zbkv: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """(st_zbnkv, state after the last chunk) with init = the state before the first real token (or
    None). N = S / C cheap steps over all heads at once; a matmul over chunks would cost N^2 D^2.
    Consumes kv: st is written over it (one large buffer fewer to allocate and fault in)."""
    if init_zbkv is not None:
        kv = per_q_head(kv, init_zbkv.shape[0])
    run = torch.zeros_like(kv[:, :, 0]) if init_zbkv is None else init_zbkv
    for i in range(kv.shape[2]):
        step = blk.step0 if i == 0 else blk.step
        nxt = kv[:, :, i] + run if step is None else torch.addcmul(kv[:, :, i], run, step)
        kv[:, :, i] = run
        run = nxt
    return kv, run


def fold_state(blk: Block, st: Tensor, final: Tensor, init_zbkv: Tensor) -> Tuple[Tensor, Tensor]:
    """scan_states(kv, init) from scan_states(kv, None) in one vectorized pass: st_i += lambda^(C i - pad) init
    (chunk 0: init itself, read with q_in0), final += lambda^S init."""
    st, final = per_q_head(st, init_zbkv.shape[0]), per_q_head(final, init_zbkv.shape[0])
    if blk.decay_h is None:
        return st.add_(init_zbkv.unsqueeze(2)), final + init_zbkv
    n, c = st.shape[2], blk.q.shape[2]
    exps = torch.cat([(torch.arange(n, device=st.device) * c - blk.pad).clamp(min=0),
                      torch.tensor([n * c - blk.pad], device=st.device)])
    pw = powers(blk.decay_h, exps, st.dtype)                          # [H, N+1, 1]
    st.addcmul_(pw[:, None, :n, :, None], init_zbkv.unsqueeze(2))
    return st, torch.addcmul(final, pw[:, None, n:], init_zbkv)


def scan_states_backward(blk: Block, dh: Tensor, d_final: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """(dnext_zbnkv: gradient w.r.t. the state AFTER each chunk, gradient w.r.t. the state before the
    first real token), walking the chunks in reverse; dh_zbnkv is the gradient reaching the state
    before each chunk directly from that chunk's outputs, d_final the one reaching the state after.
    Consumes dh: dnext is written over it."""
    run = torch.zeros_like(dh[:, :, 0]) if d_final is None else d_final
    for i in range(dh.shape[2] - 1, -1, -1):
        step = blk.step0 if i == 0 else blk.step
        nxt = dh[:, :, i] + run if step is None else torch.addcmul(dh[:, :, i], run, step)
        dh[:, :, i] = run
        run = nxt
    return dh, run


def fold_backward(blk: Block, dnext: Tensor, d_final: Tensor) -> Tensor:
    """scan_states_backward(dh, d_final)'s dnext from scan_states_backward(dh, None)'s: += lambda^(C (N-1-i)) d_final."""
    if blk.decay_h is None:
        return dnext.add_(d_final.unsqueeze(2))
    n, c = dnext.shape[2], blk.q.shape[2]
    pw = powers(blk.decay_h, torch.arange(n - 1, -1, -1, device=dnext.device) * c, dnext.dtype)   # [H, N, 1]
    return dnext.addcmul_(pw[:, None, :, :, None], d_final.unsqueeze(2))


def expand_state(st_zbkv: Tensor, heads: int) -> Tensor:
    st_bzkv = st_zbkv.transpose(0, 1)
    return st_bzkv.repeat_interleave(heads // st_bzkv.shape[1], dim=1).contiguous()   # [B, H, Dk, Dv]


def reduce_state(dstate_bhkv: Tensor, state_heads: int, dtype: torch.dtype) -> Tensor:
    b, h, dk, dv = dstate_bhkv.shape
    d_zbkv = dstate_bhkv.to(dtype).transpose(0, 1)
    if state_heads == h:
        return d_zbkv.contiguous()
    return d_zbkv.reshape(state_heads, h // state_heads, b, dk, dv).sum(1)   # q heads sharing a state
