"""Chunked causal linear attention with optional per-head decay, and a plain reference.

    o_t = q_t . sum_{s<=t} lambda^(t-s) k_s^T v_s       per batch and q head; no normalisation and
                                                          no feature map (the layer applies those)
Legend (names carry layout):
    q_bshd        [B, S, H, Dk]          queries of this block (S local tokens)
    k_bshd        [B, S, Hkv, Dk]        keys; q head h reads kv head h // G, G = H // Hkv (v_bshd alike)
    decay_h       [H]                    per-q-head lambda in (0, 1], or None (= 1); never learned
    x_bnchd       [B, N, C, H, D]        a view of x_bshd in N chunks of C tokens (front-padded if needed)
    x_mcd         [B*N, C, D]            one head's chunks: a strided view, the batch of every bmm
    st_zbnkv      [Hs, B, N, Dk, Dv]     state before each chunk (fp32); Hs = H with decay (each q head
                                         decays its own state), Hkv without (a kv group shares it)
    state_bhkv    [B, H, Dk, Dv]         a block's state, the contract with the LASP strategy;
                                         fp32 (fp64 for fp64 inputs), even for bf16 inputs
Block decomposition the LASP strategy relies on (t = local position, S = block length):
    o_t         = intra(q, k, v)_t + lambda^(t+1) q_t . state_in        intra_forward + state_output
    state_local = sum_s lambda^(S-1-s) k_s^T v_s  (excludes state_in)
    state after the block = lambda^S state_in + state_local              (state_decay gives lambda^S)
so a strategy can overlap: state_local(k, v) first (to send), intra_forward while states travel,
then state_output(..., out=o); in backward, state_output_backward gives dstate_in from q and do
alone, intra_backward runs while dstate_local travels, and state_local_backward adds its dk, dv
(chunked_* do all of it in one call).
Work is a Python loop over heads of batched matmuls on strided per-head views: no layout copies of
q/k/v, K/V never repeated for GQA, and one head's working set stays in cache. Forward and backward
are explicit functions; LinearAttentionFunction only saves tensors and calls them. Powers of lambda
are exp(n log lambda) with n >= 0, so nothing is ever divided by a tiny power.
"""
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor


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
    if h % k_bshd.shape[2]:
        raise ValueError(f"linear attention: q heads ({h}) must be a multiple of kv heads ({k_bshd.shape[2]})")
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


def _powers(decay_h: Tensor, exponents: Tensor, dtype: torch.dtype) -> Tensor:
    """lambda_h^e as [H, len(e), 1] in dtype, via exp(e log lambda) in fp32/fp64 (e >= 0: no overflow).
    Powers below dtype's smallest normal number are exactly 0 (flush to zero): LASP's state terms
    reach lambda^S over a whole block, and denormal multipliers make CPU matmuls and products several
    times slower, while what they weight is negligible beside the weight-1 terms of the same sums."""
    log_h1 = decay_h.to(exponents.device, state_dtype(dtype)).log().view(-1, 1)   # [H, 1]
    pw_he = torch.exp(exponents.to(log_h1.dtype) * log_h1).to(dtype)
    return pw_he.masked_fill(pw_he < torch.finfo(dtype).tiny, 0).unsqueeze(-1)


def _position_decay(decay_h: Tensor, like_bshd: Tensor, offset: int) -> Tensor:
    """lambda^(t+offset) for t = 0..S-1 as [H, S, 1], on like's device and in like's dtype."""
    pos = torch.arange(offset, like_bshd.shape[1] + offset, device=like_bshd.device)
    return _powers(decay_h, pos, like_bshd.dtype)


def state_decay(decay_h: Optional[Tensor], length: int, dtype=torch.float32) -> Optional[Tensor]:
    """lambda^length per q head as [H, 1, 1] (None without decay): carries a state across a block."""
    if decay_h is None:
        return None
    return torch.exp(length * decay_h.to(dtype).log()).view(-1, 1, 1)


class _Block(NamedTuple):
    q: Tensor                # q_bnchd (front-padded so that N*C = S + pad)
    k: Tensor                # k_bnchd
    v: Tensor                # v_bnchd
    pad: int
    kv_heads: int
    state_heads: int         # Hs: H with decay, Hkv without
    mask: Tensor             # [H, C, C] causal mask * lambda^(i-j) (expanded view without decay)
    q_in: Optional[Tensor]   # [H, C, 1] lambda^(i+1): state before the chunk -> query i
    k_out: Optional[Tensor]  # [H, C, 1] lambda^(C-1-j): key j -> state after the chunk
    step: Optional[Tensor]   # [H, 1, 1, 1] lambda^C: state before -> after one chunk (state dtype)


def _chunked(x_bshd: Tensor, chunk: int) -> Tuple[Tensor, int]:
    """x_bshd -> (x_bnchd, pad). Zero padding goes at the FRONT: zero keys and values add nothing to
    any state and all decays are relative, so padded chunks need no correction (padding at the end
    would need a division by lambda^pad)."""
    b, s, h, d = x_bshd.shape
    n = -(-s // chunk)
    pad = n * chunk - s
    if pad:
        x_bshd = F.pad(x_bshd, (0, 0, 0, 0, pad, 0))
    return x_bshd.reshape(b, n, chunk, h, d), pad                     # a view for contiguous inputs


def _head(x_bnchd: Tensor, h: int) -> Tensor:
    b, n, c, _, d = x_bnchd.shape
    return x_bnchd[:, :, :, h].reshape(b * n, c, d)      # x_mcd: a view for contiguous inputs


def _prepare(q_bshd, k_bshd, v_bshd, decay_h, chunk_size) -> _Block:
    check_inputs(q_bshd, k_bshd, v_bshd, decay_h)
    if chunk_size < 1:
        raise ValueError(f"linear attention: chunk_size must be >= 1; got {chunk_size}")
    h, hkv = q_bshd.shape[2], k_bshd.shape[2]
    c = min(chunk_size, q_bshd.shape[1])
    (q, pad), (k, _), (v, _) = (_chunked(x, c) for x in (q_bshd, k_bshd, v_bshd))
    pos = torch.arange(c, device=q_bshd.device)
    causal = (pos[:, None] >= pos[None, :]).to(q_bshd.dtype)
    if decay_h is None:
        return _Block(q, k, v, pad, hkv, hkv, causal.expand(h, c, c), None, None, None)
    # exponent i-j clamped at 0 above the diagonal: those entries are masked, and must not overflow
    age = (pos[:, None] - pos[None, :]).clamp(min=0).flatten()
    mask = _powers(decay_h, age, q_bshd.dtype).view(h, c, c) * causal
    step = _powers(decay_h, torch.tensor([c], device=pos.device), state_dtype(q_bshd.dtype)).view(h, 1, 1, 1)
    return _Block(q, k, v, pad, hkv, h, mask, _powers(decay_h, pos + 1, q_bshd.dtype),
                  _powers(decay_h, c - 1 - pos, q_bshd.dtype), step)


# ----------------------------------------------------------------------------- state plumbing
def _bmm_acc(out: Tensor, a: Tensor, b: Tensor, first: bool) -> None:
    """out = a @ b (first) or out += a @ b; out may be a wider (state) dtype than a and b. Writing
    the first term instead of zero-filling saves a pass over memory (beta=0 ignores out's garbage)."""
    if out.dtype == a.dtype:
        out.baddbmm_(a, b, beta=0.0 if first else 1.0)
    elif first:
        out.copy_(torch.bmm(a, b))
    else:
        out.add_(torch.bmm(a, b))


def _kv_of_state(blk: _Block, hs: int) -> int:
    return hs // (blk.state_heads // blk.kv_heads)


def _chunk_states(blk: _Block) -> Tuple[Tensor, Tensor]:
    """(st_zbnkv: state before each chunk, state after the last chunk [Hs, B, Dk, Dv])."""
    b, n, c, _, dk = blk.k.shape
    dv = blk.v.shape[-1]
    kv = torch.empty(blk.state_heads, b, n, dk, dv, dtype=state_dtype(blk.k.dtype), device=blk.k.device)
    for hs in range(blk.state_heads):                    # each chunk's own part
        k_mcd = _head(blk.k, _kv_of_state(blk, hs))
        k_mcd = k_mcd if blk.k_out is None else k_mcd * blk.k_out[hs]
        _bmm_acc(kv[hs].view(b * n, dk, dv), k_mcd.transpose(1, 2), _head(blk.v, _kv_of_state(blk, hs)), True)
    st = torch.empty_like(kv)
    run = torch.zeros_like(kv[:, :, 0])
    # N = S / C cheap steps over all heads at once; a matmul over chunks would cost N^2 D^2
    for i in range(n):
        st[:, :, i] = run
        run = kv[:, :, i] + run if blk.step is None else torch.addcmul(kv[:, :, i], run, blk.step)
    return st, run


def _chunk_states_backward(dh_zbnkv: Tensor, step: Optional[Tensor], d_final: Optional[Tensor]) -> Tensor:
    """Gradient w.r.t. the state AFTER each chunk, walking the chunks in reverse; dh_zbnkv is the
    gradient reaching the state before each chunk directly from that chunk's outputs."""
    dnext = torch.empty_like(dh_zbnkv)
    run = torch.zeros_like(dh_zbnkv[:, :, 0]) if d_final is None else d_final
    for i in range(dh_zbnkv.shape[2] - 1, -1, -1):
        dnext[:, :, i] = run
        run = dh_zbnkv[:, :, i] + run if step is None else torch.addcmul(dh_zbnkv[:, :, i], run, step)
    return dnext


def _expand_state(st_zbkv: Tensor, heads: int) -> Tensor:
    st_bzkv = st_zbkv.transpose(0, 1)
    return st_bzkv.repeat_interleave(heads // st_bzkv.shape[1], dim=1).contiguous()   # [B, H, Dk, Dv]


def _reduce_state(dstate_bhkv: Tensor, state_heads: int, dtype: torch.dtype) -> Tensor:
    b, h, dk, dv = dstate_bhkv.shape
    d_zbkv = dstate_bhkv.to(dtype).transpose(0, 1)
    if state_heads == h:
        return d_zbkv.contiguous()
    return d_zbkv.reshape(state_heads, h // state_heads, b, dk, dv).sum(1)   # q heads sharing a state


# ----------------------------------------------------------------------------- forward
def intra_forward(q_bshd, k_bshd, v_bshd, decay_h=None, chunk_size=64) -> Tuple[Tensor, Tensor]:
    """This block alone (as if state_in = 0): (o_bshd, state_local_bhkv). Needs nothing from other ranks."""
    blk = _prepare(q_bshd, k_bshd, v_bshd, decay_h, chunk_size)
    b, n, c, h, dk = blk.q.shape
    st, final = _chunk_states(blk)
    o = blk.q.new_empty(b, n * c, h, blk.v.shape[-1])
    for qh in range(h):
        kvh, hs = qh // (h // blk.kv_heads), qh // (h // blk.state_heads)
        q_mcd, k_mcd, v_mcd = _head(blk.q, qh), _head(blk.k, kvh), _head(blk.v, kvh)
        o_mcd = torch.bmm(torch.bmm(q_mcd, k_mcd.transpose(1, 2)).mul_(blk.mask[qh]), v_mcd)
        if n > 1:                                        # earlier chunks of this block, through the states
            qd_mcd = q_mcd if blk.q_in is None else q_mcd * blk.q_in[qh]
            o_mcd.baddbmm_(qd_mcd, st[hs].view(b * n, dk, -1).to(o.dtype))
        o[:, :, qh] = o_mcd.view(b, n * c, -1)
    return o[:, blk.pad:], _expand_state(final, h)


def state_local(k_bshd: Tensor, v_bshd: Tensor, num_heads: int, decay_h: Optional[Tensor] = None) -> Tensor:
    """state_local_bhkv = sum_s lambda^(S-1-s) k_s^T v_s per q head, from k and v alone: what a
    LASP rank sends before its intra work (intra_forward returns the same state, but only after
    all of that work). One [Dk, S] x [S, Dv] matmul per state head."""
    b, s, hkv, dk = k_bshd.shape
    hs_count = num_heads if decay_h is not None else hkv
    k_out = None if decay_h is None else _position_decay(decay_h, k_bshd, 0).flip(1)   # lambda^(S-1-t)
    st_zbkv = k_bshd.new_empty(hs_count, b, dk, v_bshd.shape[-1], dtype=state_dtype(k_bshd.dtype))
    for hs in range(hs_count):
        kvh = hs // (hs_count // hkv)
        k_bsd = k_bshd[:, :, kvh] if k_out is None else k_bshd[:, :, kvh] * k_out[hs]
        _bmm_acc(st_zbkv[hs], k_bsd.transpose(1, 2), v_bshd[:, :, kvh], True)
    return _expand_state(st_zbkv, num_heads)


def state_output(q_bshd: Tensor, state_in_bhkv: Tensor, decay_h: Optional[Tensor] = None,
                 out: Optional[Tensor] = None) -> Tensor:
    """The earlier ranks' share of o, lambda^(t+1) q_t . state_in, as [B, S, H, Dv]; added into out
    (e.g. intra_forward's o, once state_in has arrived) when given."""
    b, s, h, _ = q_bshd.shape
    if out is None:
        out = q_bshd.new_zeros(b, s, h, state_in_bhkv.shape[-1])
    decay_hs1 = None if decay_h is None else _position_decay(decay_h, q_bshd, 1)
    for qh in range(h):
        o_bsd = torch.bmm(q_bshd[:, :, qh], state_in_bhkv[:, qh].to(q_bshd.dtype))
        out[:, :, qh] += o_bsd if decay_hs1 is None else o_bsd * decay_hs1[qh]
    return out


def chunked_forward(q_bshd, k_bshd, v_bshd, decay_h=None, chunk_size=64, state_in_bhkv=None):
    """(o_bshd, state_local_bhkv) for one block given the state of all earlier tokens (or None)."""
    o, state_local = intra_forward(q_bshd, k_bshd, v_bshd, decay_h, chunk_size)
    if state_in_bhkv is not None:
        state_output(q_bshd, state_in_bhkv, decay_h, out=o)
    return o, state_local


# ----------------------------------------------------------------------------- backward
def _backward_per_head(blk: _Block, do_bnchd: Tensor, st: Optional[Tensor], dh: Optional[Tensor]):
    """Per q head: dq (intra + through the states), dk/dv intra parts summed over each kv group in
    [Hkv, B*N, C, D] accumulators, and dh (gradient reaching each chunk's incoming state)."""
    b, n, c, h, dk = blk.q.shape
    dq = blk.q.new_empty(b, n * c, h, dk)
    dk_acc = blk.k.new_empty(blk.kv_heads, b * n, c, dk)
    dv_acc = blk.v.new_empty(blk.kv_heads, b * n, c, blk.v.shape[-1])
    for qh in range(h):
        kvh, hs = qh // (h // blk.kv_heads), qh // (h // blk.state_heads)
        beta = 0.0 if qh % (h // blk.kv_heads) == 0 else 1.0          # first q head of its kv group
        q_mcd, k_mcd, v_mcd, do_mcd = (_head(x, i) for x, i in ((blk.q, qh), (blk.k, kvh), (blk.v, kvh),
                                                                 (do_bnchd, qh)))
        scores = torch.bmm(q_mcd, k_mcd.transpose(1, 2)).mul_(blk.mask[qh])      # recomputed, not saved
        dscores = torch.bmm(do_mcd, v_mcd.transpose(1, 2)).mul_(blk.mask[qh])
        dq_mcd = torch.bmm(dscores, k_mcd)
        dk_acc[kvh].baddbmm_(dscores.transpose(1, 2), q_mcd, beta=beta)
        dv_acc[kvh].baddbmm_(scores.transpose(1, 2), do_mcd, beta=beta)
        if dh is not None:
            # lambda^(i+1) scales row i of do rather than q: it then serves both dq and dh
            dod_mcd = do_mcd if blk.q_in is None else do_mcd * blk.q_in[qh]
            if st is not None:
                dq_mcd.baddbmm_(dod_mcd, st[hs].view(b * n, dk, -1).to(dq.dtype).transpose(1, 2))
            _bmm_acc(dh[hs].view(b * n, dk, -1), q_mcd.transpose(1, 2), dod_mcd, qh % (h // blk.state_heads) == 0)
        dq[:, :, qh] = dq_mcd.view(b, n * c, dk)
    return dq, dk_acc, dv_acc


def _backward_states(blk: _Block, dnext: Tensor, dk_acc: Tensor, dv_acc: Tensor) -> None:
    """dk, dv of every key/value through the states after its chunk: dk_j += lambda^(C-1-j) v_j dS^T."""
    b, n, c, _, dk = blk.k.shape
    for hs in range(blk.state_heads):
        kvh = _kv_of_state(blk, hs)
        k_mcd, v_mcd = _head(blk.k, kvh), _head(blk.v, kvh)
        if blk.k_out is not None:
            k_mcd, v_mcd = k_mcd * blk.k_out[hs], v_mcd * blk.k_out[hs]
        d_mkv = dnext[hs].view(b * n, dk, -1).to(k_mcd.dtype)
        dk_acc[kvh].baddbmm_(v_mcd, d_mkv.transpose(1, 2))
        dv_acc[kvh].baddbmm_(k_mcd, d_mkv)


def _unchunk(acc_zmcd: Tensor, b: int, pad: int) -> Tensor:
    z, m, c, d = acc_zmcd.shape
    return acc_zmcd.view(z, b, m // b * c, d).permute(1, 2, 0, 3)[:, pad:].contiguous()   # [B, S, Z, D]


def intra_backward(do_bshd, q_bshd, k_bshd, v_bshd, decay_h=None, chunk_size=64, dstate_local_bhkv=None):
    """(dq, dk, dv) of intra_forward. dstate_local (gradient of state_local from later ranks) is folded
    into the reverse chunk walk for free; pass None and use state_local_backward to add it later."""
    blk = _prepare(q_bshd, k_bshd, v_bshd, decay_h, chunk_size)
    b, n, c, h, dk = blk.q.shape
    do_bnchd, _ = _chunked(do_bshd, c)
    sdt = state_dtype(q_bshd.dtype)
    d_final = None if dstate_local_bhkv is None else _reduce_state(dstate_local_bhkv, blk.state_heads, sdt)
    through_states = n > 1 or d_final is not None
    st = _chunk_states(blk)[0] if n > 1 else None
    dh = blk.q.new_empty(blk.state_heads, b, n, dk, blk.v.shape[-1], dtype=sdt) if through_states else None
    dq, dk_acc, dv_acc = _backward_per_head(blk, do_bnchd, st, dh)
    if through_states:
        _backward_states(blk, _chunk_states_backward(dh, blk.step, d_final), dk_acc, dv_acc)
    return dq[:, blk.pad:], _unchunk(dk_acc, b, blk.pad), _unchunk(dv_acc, b, blk.pad)


def state_output_backward(do_bshd, q_bshd, state_in_bhkv=None, decay_h=None):
    """(dq from the state_in term or None, dstate_in_bhkv to send to earlier ranks). dstate_in needs
    only q and do, so it can be sent before any other backward work."""
    b, s, h, dk = q_bshd.shape
    decay_hs1 = None if decay_h is None else _position_decay(decay_h, q_bshd, 1)
    dstate_in = q_bshd.new_empty(b, h, dk, do_bshd.shape[-1], dtype=state_dtype(q_bshd.dtype))
    dq = None if state_in_bhkv is None else torch.empty_like(q_bshd)
    for qh in range(h):
        dod_bsd = do_bshd[:, :, qh] if decay_hs1 is None else do_bshd[:, :, qh] * decay_hs1[qh]
        dstate_in[:, qh] = torch.bmm(q_bshd[:, :, qh].transpose(1, 2), dod_bsd)
        if dq is not None:
            dq[:, :, qh] = torch.bmm(dod_bsd, state_in_bhkv[:, qh].to(dod_bsd.dtype).transpose(1, 2))
    return dq, dstate_in


def state_local_backward(k_bshd, v_bshd, dstate_local_bhkv, decay_h=None):
    """(dk, dv) from the gradient of state_local = sum_s lambda^(S-1-s) k_s^T v_s (from later ranks)."""
    b, s, hkv, dk = k_bshd.shape
    h = dstate_local_bhkv.shape[1]
    hs_count = h if decay_h is not None else hkv
    d_zbkv = _reduce_state(dstate_local_bhkv, hs_count, k_bshd.dtype)
    k_out = None if decay_h is None else _position_decay(decay_h, k_bshd, 0).flip(1)   # lambda^(S-1-t)
    dk_out, dv_out = torch.zeros_like(k_bshd), torch.zeros_like(v_bshd)
    for hs in range(hs_count):
        kvh = hs // (hs_count // hkv)
        k_bsd, v_bsd = k_bshd[:, :, kvh], v_bshd[:, :, kvh]
        if k_out is not None:
            k_bsd, v_bsd = k_bsd * k_out[hs], v_bsd * k_out[hs]
        dk_out[:, :, kvh] += torch.bmm(v_bsd, d_zbkv[hs].transpose(1, 2))
        dv_out[:, :, kvh] += torch.bmm(k_bsd, d_zbkv[hs])
    return dk_out, dv_out


def chunked_backward(do_bshd, q_bshd, k_bshd, v_bshd, decay_h=None, chunk_size=64,
                     state_in_bhkv=None, dstate_local_bhkv=None):
    """(dq, dk, dv, dstate_in) of chunked_forward; dstate_in is None when state_in is None."""
    dq, dk, dv = intra_backward(do_bshd, q_bshd, k_bshd, v_bshd, decay_h, chunk_size, dstate_local_bhkv)
    if state_in_bhkv is None:
        return dq, dk, dv, None
    dq_state, dstate_in = state_output_backward(do_bshd, q_bshd, state_in_bhkv, decay_h)
    return dq + dq_state, dk, dv, dstate_in


# ----------------------------------------------------------------------------- autograd and entry point
class LinearAttentionFunction(torch.autograd.Function):
    """Single-process causal linear attention; saves q, k, v only (chunk states are recomputed)."""

    @staticmethod
    def forward(ctx, q_bshd, k_bshd, v_bshd, decay_h, chunk_size):
        o, _ = intra_forward(q_bshd, k_bshd, v_bshd, decay_h, chunk_size)
        ctx.save_for_backward(q_bshd, k_bshd, v_bshd)
        ctx.decay_h, ctx.chunk_size = decay_h, chunk_size
        return o

    @staticmethod
    def backward(ctx, do_bshd):
        q, k, v = ctx.saved_tensors
        dq, dk, dv = intra_backward(do_bshd, q, k, v, ctx.decay_h, ctx.chunk_size)
        return dq, dk, dv, None, None


def linear_attention(q_bshd, k_bshd, v_bshd, decay_h=None, chunk_size=64) -> Tensor:
    """Causal linear attention over the whole sequence on one process: O(S*C*D + S*D^2)."""
    return LinearAttentionFunction.apply(q_bshd, k_bshd, v_bshd, decay_h, chunk_size)


def linear_attention_reference(q_bshd, k_bshd, v_bshd, decay_h=None) -> Tensor:
    """Quadratic masked form, differentiable by autograd, computed in q's dtype (tests use float64).
    O(S^2) memory: for tests and tiny inputs only. Repeats K/V over the group for plainness."""
    s, h = q_bshd.shape[1], q_bshd.shape[2]
    g = h // k_bshd.shape[2]
    k, v = k_bshd.repeat_interleave(g, dim=2), v_bshd.repeat_interleave(g, dim=2)
    scores = torch.einsum("bshd,bthd->bhst", q_bshd, k)                           # [B, H, S, S]
    pos = torch.arange(s, device=q_bshd.device)
    age = pos[:, None] - pos[None, :]                                            # t - s
    weight = (age >= 0).to(q_bshd.dtype)
    if decay_h is not None:
        log_h11 = decay_h.detach().to(q_bshd.dtype).log().view(h, 1, 1)
        weight = torch.exp(age.clamp(min=0).to(q_bshd.dtype) * log_h11) * weight  # [H, S, S]
    return torch.einsum("bhst,bthd->bshd", scores * weight, v)
