"""ShardedKVCache: a transformers ``Cache`` whose layers hold only this rank's tokens' keys and values,
each with its global position, so no rank ever holds the whole cache.

transformers' generate loop and attention layers use it as any cache: ``update(k, v, layer_idx)`` from
every attention layer, ``get_seq_length()`` (the GLOBAL number of tokens processed, which generate
and the models number positions from). What ``update`` stores and returns depends on the phase that
hf/generate.py sets before each forward:

  * prefill: the layer gets this rank's shard of the prompt (the training layout); the real tokens'
    K/V (not the layout's end padding) are kept and the shard is returned as it came, so the
    strategy's attention runs exactly as in a training forward;
  * decode: the new token's K/V is appended on its owner rank only (strategies/decode.py: the
    smallest share, ties to the lowest rank); every rank gets back its own cached keys, which the
    decode attention merges across the group.

A sliding-window layer drops, after each attention call, the keys the next query can no longer see
(``trim``): it never holds more than ``window`` keys on any rank (a left-padded batch: the union of the
rows' windows, which are shifted by the rows' padding).

Left-padded batches (hf/generate.py rotates each row so its real tokens lead): the cache stays one
tensor per layer for the whole batch, so every row keeps the same slots, but the slots mean different
things per row. ``positions`` [m] stays the slot's global index (the same for every row: ownership and
shares count slots); ``row_positions`` [b, m] is each row's position id of the token in the slot, the
one the unsharded generate gives it (cumsum(mask) - 1), and ``PAD`` (-1) for a rotated-away pad, which
decode never attends (strategies/decode.py masks it). A prompt slot g holds row b's real token iff
g < lengths[b] (position g); decode step t's slot holds position lengths[b] + t in every row. Without
padding ``row_positions`` is None and everything runs as before.

Hybrids: a linear-attention / SSM / short-convolution layer holds no per-token keys but a conv state (its
last K inputs) and a recurrent state, which its decode steps read through transformers' own cache API
(``get_conv_state``, ``update_recurrent_state``). Those layers get a ``ReplicatedStateLayer``, the same on
every rank: in the prefill its conv state is the whole prompt's last K inputs (one all-reduce,
strategies/decode.py: prompt_tail) and its recurrent state the one the op's seam returned (already the
state after the last prompt token on every rank, hf/linear/prefill.py); the decode steps then update both
in place exactly as transformers' LinearAttentionLayer does, identically on every rank.
"""
from __future__ import annotations

from typing import Collection, List, Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionLayer

from ..strategies.decode import next_owner, prompt_shares, prompt_tail
from .checks import UnsupportedModelError

PAD = -1                     # row_positions of a slot that holds a pad of this row (never attended)


class ShardedLayer(CacheLayerMixin):
    """One attention layer's shard: keys [b, hkv, m, d], values [b, hkv, m, dv], positions [m] (the slots'
    global indices); row_positions [b, m] (left padding only, else None): each row's position of the slot."""

    is_compileable = False
    is_croppable = False

    def __init__(self, cache: "ShardedKVCache", sliding: bool = False):
        super().__init__()
        self.cache = cache
        self.is_sliding = sliding
        self.positions: Optional[torch.Tensor] = None
        self.row_positions: Optional[torch.Tensor] = None

    def lazy_initialization(self, key_states, value_states) -> None:
        self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
        self.positions = torch.empty(0, dtype=torch.long, device=key_states.device)
        if self.cache.lengths is not None:
            self.row_positions = torch.empty(key_states.shape[0], 0, dtype=torch.long, device=key_states.device)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        c = self.cache
        if c.phase == "prefill":
            keep = c.local_positions < c.prompt_len
            self._append(key_states[:, :, keep], value_states[:, :, keep], c.local_positions[keep])
            return key_states, value_states
        if c.phase != "decode":
            raise UnsupportedModelError("ds_seqpar.hf: a ShardedKVCache is used by model.generate of an applied "
                                        "model only; do not pass it to a forward call")
        if key_states.shape[2] != 1:
            raise UnsupportedModelError(f"ds_seqpar.hf: a decode step of {key_states.shape[2]} tokens; the "
                                        f"sequence-sharded cache decodes one token per step")
        if c.owner == c.rank:
            self._append(key_states, value_states, torch.full((1,), c.seen, dtype=torch.long,
                                                              device=self.positions.device))
        return self.keys, self.values

    def _append(self, k, v, pos) -> None:
        self.keys = torch.cat([self.keys, k], dim=-2)
        self.values = torch.cat([self.values, v], dim=-2)
        pos = pos.to(self.positions.device)
        self.positions = torch.cat([self.positions, pos])
        if self.row_positions is not None:
            self.row_positions = torch.cat([self.row_positions, self.cache.row_positions_of(pos)], dim=1)

    def trim(self, window: Optional[int], next_pos: int) -> None:
        """Drop the keys the query at ``next_pos`` (and every later one) cannot see: j <= next_pos - window."""
        if window is None or not self.is_initialized:
            return
        self.is_sliding = True          # also where the config names no layer_types (Mistral's one window)
        if self.row_positions is None:
            keep = self.positions > next_pos - window
        else:                           # a slot stays while some row still sees its real token there
            rows = self.row_positions
            nxt = self.cache.row_positions_of(torch.tensor([next_pos], device=rows.device))
            keep = ((rows != PAD) & (rows > nxt - window)).any(0)
        if not bool(keep.all()):
            self.keys, self.values, self.positions = self.keys[:, :, keep], self.values[:, :, keep], self.positions[keep]
            if self.row_positions is not None:
                self.row_positions = self.row_positions[:, keep]

    def get_seq_length(self) -> int:
        return self.cache.seen

    def get_mask_sizes(self, query_length: int):
        return self.cache.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def local_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def reorder_cache(self, beam_idx) -> None:
        raise UnsupportedModelError("ds_seqpar.hf: beam search (reordering a sequence-sharded cache) is not "
                                    "supported; use num_beams=1 (greedy or sampling)")

    def crop(self, tokens_to_remove: int) -> None:
        raise UnsupportedModelError("ds_seqpar.hf: cropping a sequence-sharded cache (assisted decoding) is not "
                                    "supported; generate without an assistant")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise UnsupportedModelError("ds_seqpar.hf: expanding a filled sequence-sharded cache over the batch is not "
                                    "supported; repeat the prompts in the batch before generate")

    def batch_select_indices(self, indices) -> None:
        raise UnsupportedModelError("ds_seqpar.hf: selecting rows of a sequence-sharded cache is not supported")


class ReplicatedStateLayer(LinearAttentionLayer):
    """One linear-attention / SSM / conv layer's states, the same on every rank of the group (module doc)."""

    def __init__(self, cache: "ShardedKVCache"):
        super().__init__()
        self.cache = cache

    def update_conv_state(self, conv_states, state_idx: int = 0, conv_kernel_size: Optional[int] = None, **kwargs):
        c = self.cache
        if c.phase != "prefill":
            return super().update_conv_state(conv_states, state_idx, conv_kernel_size, **kwargs)
        if conv_kernel_size is None:
            raise UnsupportedModelError("ds_seqpar.hf: a conv layer that caches its prompt without its kernel width "
                                        "(update_conv_state without conv_kernel_size); generate on one process")
        # conv_states: this rank's shard [b, c, local]; the cache keeps the whole prompt's last K inputs
        tail = prompt_tail(conv_states, c.local_positions, c.prompt_len, conv_kernel_size, c.group, c.stats)
        super().update_conv_state(tail, state_idx, conv_kernel_size=conv_kernel_size)
        return conv_states           # the shard, for the layer's sequence-parallel conv (its halo)

    def local_bytes(self) -> int:
        """Bytes of the states this rank holds (every rank holds the same)."""
        return sum(t.numel() * t.element_size() for states in (self.conv_states, self.recurrent_states)
                   for t in states.values() if t is not None)


class ShardedHybridLayer(ReplicatedStateLayer, ShardedLayer):
    """A layer with softmax attention and a linear mixer side by side (Falcon-H1): this rank's K/V shard and the
    replicated states in one cache slot, as transformers' LinearAttentionAndFullAttentionLayer pairs them."""

    is_compileable = False

    def __init__(self, cache: "ShardedKVCache", sliding: bool = False):
        ShardedLayer.__init__(self, cache, sliding)
        LinearAttentionLayer.__init__(self)

    def lazy_initialization(self, *args, **kwargs) -> None:
        if len(args) == 2 and not kwargs:            # update(k, v): the attention part
            return ShardedLayer.lazy_initialization(self, *args)
        return LinearAttentionLayer.lazy_initialization(self, *args, **kwargs)

    def local_bytes(self) -> int:
        return ShardedLayer.local_bytes(self) + ReplicatedStateLayer.local_bytes(self)


class ShardedKVCache(Cache):
    """The cache of one sequence group's generate call: every rank holds one, with its own tokens.

    ``shares[r]``: tokens rank r has received so far (prompt tokens by the layout, then each generated
    token on ``next_owner(shares)``); the same numbers on every rank, computed, never communicated."""

    def __init__(self, num_layers: int, sliding: List[bool], sp_size: int, rank: int, states: Collection[int] = (),
                 group=None, stats=None, attention: Optional[Collection[int]] = None):
        """``states``: the layer indices of linear-attention / SSM / conv layers (ReplicatedStateLayer), those
        also in ``attention`` (the softmax layers' indices; None: every other layer) both (ShardedHybridLayer);
        ``group``, ``stats``: the sequence group the prefill gathers their conv states over."""
        def layer(i, s):
            if i not in states:
                return ShardedLayer(self, s)
            both = attention is not None and i in attention
            return ShardedHybridLayer(self, s) if both else ReplicatedStateLayer(self)
        super().__init__(layers=[layer(i, s) for i, s in enumerate(sliding[:num_layers])])
        self.rank, self.size = rank, sp_size
        self.group, self.stats = group, stats
        self.phase: Optional[str] = None
        self.seen = 0                   # global tokens whose K/V are in the group's cache
        self.prompt_len = 0
        self.local_positions: Optional[torch.Tensor] = None
        self.shares = [0] * sp_size
        self.owner: Optional[int] = None
        self.lengths: Optional[torch.Tensor] = None     # [b] each row's real prompt tokens (left padding only)

    def begin_prefill(self, layout, prompt_len: int, padded_len: int, local_positions: torch.Tensor,
                      lengths: Optional[torch.Tensor] = None) -> None:
        """``lengths`` [b]: each row's real prompt tokens, its real tokens leading (a rotated left-padded
        batch); None: every row is ``prompt_len`` real tokens."""
        if self.seen:
            raise UnsupportedModelError("ds_seqpar.hf: a second prefill into a filled sequence-sharded cache "
                                        "(continuing from a cache) is not supported; start a new generate call")
        self.phase, self.prompt_len, self.local_positions = "prefill", prompt_len, local_positions
        self.lengths = None if lengths is None else lengths.to(torch.long)
        self.shares = prompt_shares(layout, prompt_len, padded_len)

    def row_positions_of(self, slots: torch.Tensor) -> torch.Tensor:
        """[b, k] each row's position id of global slots [k] (left padding): a prompt slot g < prompt_len holds
        row b's real token g iff g < lengths[b] (else PAD); decode slot prompt_len + t holds lengths[b] + t."""
        lengths = self.lengths.to(slots.device)[:, None]
        slots = slots[None]
        prompt = torch.where(slots < lengths, slots, torch.full_like(slots, PAD))
        return torch.where(slots < self.prompt_len, prompt, slots - self.prompt_len + lengths)

    def begin_decode(self) -> int:
        """The step's token goes to the rank with the smallest share; returns its global position."""
        self.phase = "decode"
        self.owner = next_owner(self.shares)
        return self.seen

    def end_step(self) -> None:
        if self.phase == "prefill":
            self.seen = self.prompt_len
        elif self.phase == "decode":
            self.shares[self.owner] += 1
            self.seen += 1
        self.phase = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The global tokens processed (also with no attention layer, or a linear layer first)."""
        return self.seen

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
        return self.seen + query_length, 0

    def local_bytes(self) -> int:
        """Bytes of K/V (and hybrids' replicated states) this rank holds (every layer)."""
        return sum(layer.local_bytes() for layer in self.layers)


__all__ = ["ShardedKVCache", "ShardedLayer", "ReplicatedStateLayer", "ShardedHybridLayer", "PAD"]
