"""Per-token log-probs and entropy (ds_seqpar/logprobs.py) on one process: values and gradients against a
float64 log_softmax reference, chunked and tempered, from logits and with the head fused in."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ds_seqpar.logprobs import token_logprobs, token_logprobs_from_hidden

from ..reference import assert_derived_close

B, L, V, H = 2, 13, 37, 8


def reference(logits, labels, temperature):
    """(logp, entropy) by plain log_softmax in logits' dtype; 0 where the label is ignored."""
    logp_all = F.log_softmax(logits / temperature, dim=-1)
    valid = labels != -100
    logp = torch.where(valid, logp_all.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1), 0.0)
    ent = torch.where(valid, -(logp_all.exp() * logp_all).sum(-1), 0.0)
    return logp, ent


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, L, H, generator=g)
    weight, bias = torch.randn(V, H, generator=g), torch.randn(V, generator=g)
    labels = torch.randint(0, V, (B, L), generator=g)
    labels[torch.rand(B, L, generator=g) < 0.3] = -100
    w_lp, w_ent = torch.randn(B, L, generator=g), torch.randn(B, L, generator=g)
    return hidden, weight, bias, labels, w_lp, w_ent


def grads_of(fn, leaves, w_lp, w_ent):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    logp, ent = fn(*leaves)
    ((logp * w_lp.to(logp.dtype)).sum() + (ent * w_ent.to(ent.dtype)).sum()).backward()
    return [logp.detach(), ent.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("chunk", [0, 5, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_and_entropy_equal_log_softmax(chunk, temperature):
    hidden, weight, bias, labels, w_lp, w_ent = inputs()
    logits = F.linear(hidden, weight, bias) * 3.0        # sharp distributions: entropies far from uniform

    def ref(dtype):
        return grads_of(lambda z: reference(z, labels, temperature), [logits.to(dtype)], w_lp, w_ent)

    got = grads_of(lambda z: token_logprobs(z, labels, temperature=temperature, entropy=True, chunk_tokens=chunk),
                   [logits], w_lp, w_ent)
    for name, g, r64, plain in zip(("logp", "entropy", "d logits"), got, ref(torch.float64), ref(torch.float32)):
        assert g.dtype == torch.float32, name
        assert_derived_close(f"chunk={chunk} T={temperature} {name}", g, r64, plain)
    assert bool((got[0][labels == -100] == 0).all()) and bool((got[1][labels == -100] == 0).all())
    assert bool((got[0] <= 0).all())


@pytest.mark.parametrize("head_kind", ["module", "weight"])
def test_fused_head_logprobs_equal_the_head_then_log_softmax(head_kind):
    hidden, weight, bias, labels, w_lp, w_ent = inputs(1)

    def ref(dtype):
        return grads_of(lambda h, w, b: reference(F.linear(h, w, b), labels, 0.9),
                        [t.to(dtype) for t in (hidden, weight, bias)], w_lp, w_ent)

    def fused(h, w, b):
        if head_kind == "weight":
            return token_logprobs_from_hidden(h, w, labels, bias=b, temperature=0.9, entropy=True, chunk_tokens=4)
        head = nn.Linear(H, V)
        head.weight, head.bias = nn.Parameter(w), nn.Parameter(b)
        out = token_logprobs_from_hidden(h, head, labels, temperature=0.9, entropy=True, chunk_tokens=4)
        fused.head = head
        return out

    got = grads_of(fused, [hidden, weight, bias], w_lp, w_ent)
    if head_kind == "module":     # the module's own parameters got the gradients
        got[3], got[4] = fused.head.weight.grad, fused.head.bias.grad
    names = ("logp", "entropy", "d hidden", "d weight", "d bias")
    for name, g, r64, plain in zip(names, got, ref(torch.float64), ref(torch.float32)):
        assert g is not None, name
        assert_derived_close(f"{head_kind} {name}", g, r64, plain)


def test_logprobs_only_the_logprob_path_gets_a_gradient():
    hidden, weight, bias, labels, w_lp, _ = inputs(2)
    logits = F.linear(hidden, weight, bias).requires_grad_()
    (token_logprobs(logits, labels, chunk_tokens=3) * w_lp).sum().backward()
    ref = logits.detach().clone().requires_grad_()
    (reference(ref, labels, 1.0)[0] * w_lp).sum().backward()
    torch.testing.assert_close(logits.grad, ref.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs,match", [({"temperature": 0.0}, "temperature=0.0"),
                                          ({"temperature": True}, "temperature=True"),
                                          ({"chunk_tokens": -2}, "chunk_tokens=-2")])
def test_bad_arguments_are_refused_by_name(kwargs, match):
    hidden, weight, bias, labels, _, _ = inputs()
    with pytest.raises(ValueError, match=match):
        token_logprobs(F.linear(hidden, weight), labels, **kwargs)
    with pytest.raises(ValueError, match="integer tensor"):
        token_logprobs(F.linear(hidden, weight), labels.float())
    with pytest.raises(ValueError, match="plus a vocabulary dim"):
        token_logprobs(F.linear(hidden, weight)[:, 1:], labels)
    with pytest.raises(ValueError, match=r"must be \[vocab, hidden=8\]"):
        token_logprobs_from_hidden(hidden, weight.t(), labels)
