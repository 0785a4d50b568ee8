"""Short causal convolutions (``causal_conv1d_fn``): each run of consecutive global tokens a rank holds
is convolved with the K-1 inputs before it (the exchange's halo), and the first K-1 outputs dropped."""
from __future__ import annotations

import torch


def conv(mixers, original, call: dict):
    x = call.pop("hidden_states")                            # [b, channels, local tokens]
    width = call["weight"].shape[-1] - 1
    if width == 0:
        return original(x, **call)
    frags, resets = mixers.runs(x.shape[-1], width, f"a causal conv1d of kernel {width + 1}")
    before = mixers.exchange.halos(x, width, frags, resets)
    outs = [original(torch.cat([h.to(x.dtype), x[..., off:off + n]], -1), **call)[..., width:]
            for h, (_, n, off) in zip(before, frags[mixers.exchange.rank])]
    return outs[0] if len(outs) == 1 else torch.cat(outs, -1)


__all__ = ["conv"]
