"""The plain reference for linear attention: the quadratic masked form, the oracle the chunked
kernel (forward.py, backward.py) and LASP are tested against."""
import torch
from torch import Tensor


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
