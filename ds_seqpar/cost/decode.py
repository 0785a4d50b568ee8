"""Generation with a sequence-sharded KV cache (strategies/decode.py, hf/generate.py): the closed forms of
what each rank sends and holds.

Per decode step and attention layer, one all-gather of every rank's partial (out, lse) in the
accumulator dtype (fp32; fp64 for fp64 models): a rank sends its b x h x (dv + 1) values to P - 1 peers.
The first layer's buffer also carries the step's b input tokens (the agreement check). None of it
depends on the context length. Prefill: the training forward's bytes (bytes.py), plus one all-reduce
of the last prompt token's b x vocab logits (ring all-reduce: 2 (P - 1) / P of the buffer per rank), and for a
hybrid's linear layers the states the prompt leaves (prefill_state_bytes); their decode steps send nothing.
"""
from __future__ import annotations

from typing import Sequence

from ..strategies.decode import next_owner


def decode_merge_bytes(size: int, batch: int, heads: int, head_dim_v: int, acc_bytes: int = 4,
                       checked: bool = False) -> int:
    """Bytes one rank sends for one layer's merge of one decode step."""
    return (size - 1) * batch * (heads * (head_dim_v + 1) + int(checked)) * acc_bytes


def decode_step_bytes(size: int, layers: int, batch: int, heads: int, head_dim_v: int, acc_bytes: int = 4) -> int:
    """Bytes one rank sends for one decode step: every layer's merge, the first carrying the tokens."""
    if size <= 1:
        return 0
    return (layers * decode_merge_bytes(size, batch, heads, head_dim_v, acc_bytes)
            + (size - 1) * batch * acc_bytes)


def prefill_logits_bytes(size: int, batch: int, vocab: int, logit_bytes: int = 4) -> int:
    """The all-reduce that gives every rank the last prompt token's logits."""
    return 2 * batch * vocab * logit_bytes * (size - 1) // size if size > 1 else 0


def prefill_state_bytes(size: int, state_bytes: int, conv_bytes: int, heads_parallel: bool = False):
    """(recurrent, conv) bytes one rank sends in generate's prefill for one linear layer of a hybrid: the state
    after the last prompt token (``state_bytes``: the whole state, fp32) from its owner, an all-reduce (under
    linear_strategy ulysses: an all-gather of every rank's heads, (P - 1) / P of it), and the prompt's last K
    conv inputs (``conv_bytes``: b x channels x K in the model's dtype), an all-reduce. 0 where a layer has none."""
    if size <= 1:
        return 0, 0
    state = state_bytes // size * (size - 1) if heads_parallel else 2 * state_bytes * (size - 1) // size
    return state, 2 * conv_bytes * (size - 1) // size


def kv_cache_bytes(tokens: int, layers: int, batch: int, kv_heads: int, head_dim: int, head_dim_v: int,
                   elem: int) -> int:
    """The whole (unsharded) cache of ``tokens`` tokens over full-attention layers."""
    return tokens * layers * batch * kv_heads * (head_dim + head_dim_v) * elem


def cache_shares(prompt_shares: Sequence[int], generated: int) -> list:
    """Tokens per rank after ``generated`` more tokens, each to the smallest share (ties: lowest rank)."""
    shares = list(prompt_shares)
    for _ in range(generated):
        shares[next_owner(shares)] += 1
    return shares


__all__ = ["decode_merge_bytes", "decode_step_bytes", "prefill_logits_bytes", "prefill_state_bytes", "kv_cache_bytes",
           "cache_shares"]
