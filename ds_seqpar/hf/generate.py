"""``model.generate`` of an applied model: transformers' own loop over a sequence-sharded KV cache.

The user's call is unchanged: the prompt whole and the same on every rank of a sequence group, the
output whole on every rank. The wrapper installed by apply (``install``):

  1. refuses, before any collective and identically on every rank, what it cannot do exactly (the
     options below, by name), then checks with ONE all-reduce (max of a few int64 hashes and their
     negations) that the prompt, the generation options and, when sampling, the random state are the
     same on every rank of the group; then refuses a mask other than left padding (inner or right zeros,
     a row without real tokens);
  2. runs transformers' generate with a ShardedKVCache (kv_cache.py) as past_key_values, while
     ``state.generation`` routes the model's forwards (the hooks and the attention function ask it):
       * prefill (the prompt): sharded by the layout and run through the configured strategy as a
         training forward; each rank keeps its own real tokens' K/V; the logits of the last prompt
         token come from the rank holding it (logits_to_keep selects its row there; one all-reduce of
         b x vocab values, zero on the other ranks, so exact);
       * decode (one token, whole on every rank): each attention layer merges the ranks' partial
         attention over their shards (strategies/decode.py: one all-gather per layer); the new K/V
         goes to the rank with the smallest share (ties: the lowest rank);
  Left padding (prompts of different lengths, as transformers and TRL pad for generation): the unsharded
     generate gives a row's real tokens the positions cumsum(mask) - 1 = 0 .. L_b - 1, masks the pads out
     of every real query's keys, and gives decode step t of the row the position L_b + t. Here each row is
     rotated left by its padding, so its real tokens lead (global indices 0 .. L_b - 1, their positions
     exactly the sharded prefill's global position ids) and its pads trail (right padding): a causal
     strategy lets no real query see a later key, so every real token's K/V and hidden state is the
     unsharded one's, without any mask. The cache keeps one tensor per layer for the whole batch, so the
     rotated pads keep their slots but carry the position PAD in that row (kv_cache.py), which decode
     masks out (strategies/decode.py), as the unsharded padding mask does; each decode step's token takes
     one slot in every row with the row's own position L_b + t. A sliding window compares the rows' own
     positions, whose differences are the unsharded model's index differences. The first token's logits
     of row b are its last real token's (global index L_b - 1): each rank computes those of the rows whose
     last real token it holds (logits_to_keep: their local indices), zeros for the others, and the same
     one all-reduce of b x vocab values gives every row's logits to every rank, exactly. A batch without
     zeros runs as before, bit for bit.
  Hybrids (linear-attention / SSM / conv layers): the prefill's linear ops return the state after the last prompt
     token on every rank and the conv layers' cache keeps the prompt's last inputs (linear/prefill.py, kv_cache.py);
     each decode step runs the layers' own recurrent step on those replicated states, identically on every rank.
  3. every rank samples from the same logits with the same random state, so the tokens agree; the
     first layer's merge of every step carries the step's input tokens (a disagreement raises on every
     rank), and one all-reduce of the output's hash checks the last token.

Refused by name: beam search (num_beams > 1), assisted decoding
(assistant_model, prompt_lookup_num_tokens), a cache or past_key_values of the caller, use_cache=False,
cache_implementation, chunked prefill, inputs_embeds, output_attentions / output_hidden_states,
classifier-free guidance, custom_generate, masks other than left padding (inner or right zeros, an empty row),
a left-padded batch of a hybrid, linear layers whose decode is not verified (linear.families.DECODES: lightning
attention, Zamba's and Zamba2's Mamba layers), DeepSeek sparse attention, multimodal models,
Llama 4's chunked and temperature-tuned layers, shared-KV layers, dynamic groups, lasp.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch

from .. import comm
from .checks import UnsupportedModelError
from .generate_checks import (_crc, _same_on_ranks, check_agreement, check_left_padding, check_model,  # noqa: F401
                              check_options, text_config)
from .linear.prefill import PromptEnd
from .trl_rows import rotate     # row b rotated left by lead[b]: its real tokens lead

GENERATE_ATTR = "_ds_seqpar_own_generate"     # what the instance had under "generate" before apply (usually nothing)

class GenerationRun:
    """One generate call on one rank: the cache and how this rank routes each forward."""

    def __init__(self, sp, cache, padded: bool = False, linear=None):
        self.sp, self.cache = sp, cache
        self.linear = linear             # a hybrid's LinearMixers (hf/linear/prefill.py), or None
        self.padded = padded             # the caller's attention_mask has (left-padding) zeros
        self.position = 0                # the decode step's global position
        self.step_ids: Optional[torch.Tensor] = None
        self.checked = False             # has this step's first merge carried the tokens?
        self.last_owner, self.last_index = 0, 0
        self.kept_rows = False           # did the prefill pass logits_to_keep (the holder's row only)?
        self.row_index: Optional[torch.Tensor] = None    # left padding: [b] where each row's logits are, -1: not here
        self.row_position: Optional[torch.Tensor] = None  # left padding: [b] the decode step's position per row

    @property
    def decoding(self) -> bool:
        return self.cache.phase == "decode"

    def pre_forward(self, call: dict, params) -> dict:
        """The model's keyword arguments for this forward (generate passes every input by keyword)."""
        ids = call.get("input_ids")
        if ids is None or ids.dim() != 2:
            raise UnsupportedModelError("ds_seqpar.hf: generate under sequence parallelism runs on input_ids "
                                        "[batch, tokens]; pass input_ids, not inputs_embeds")
        kwargs = dict(call)
        kwargs["attention_mask"] = None          # no padding (refused); causality is the strategy's
        b = ids.shape[0]
        sp = self.sp
        if self.cache.seen == 0:                 # prefill: the prompt, sharded as in training
            n = ids.shape[1]
            padded = sp.padded_len(n)
            pos = sp.position_ids(n, device=ids.device)
            mask = call.get("attention_mask")
            lead = None if mask is None or bool((mask != 0).all()) else (mask == 0).sum(1).to(ids.device)
            if (lead is not None) != self.padded:   # the forward must see the mask generate was given
                raise UnsupportedModelError(f"ds_seqpar.hf: the prefill forward got "
                                            f"{'no' if self.padded else 'an unexpected'} left-padded attention_mask "
                                            f"(the call's mask {'has' if self.padded else 'has no'} zeros): this "
                                            f"model's generate does not pass the mask on; generate a batch of equal "
                                            f"lengths")
            if lead is not None:                 # left padding: each row's real tokens lead (module doc)
                ids = rotate(ids, lead)
            kwargs["input_ids"] = sp.shard(ids, dim=1)
            kwargs["position_ids"] = pos.unsqueeze(0).expand(b, -1)
            if self.linear is not None:          # the ops return the state the prompt leaves, on every rank
                self.linear.prefill = PromptEnd(n, padded)
                self.linear.documents = self.linear.prefill.documents
            self.kept_rows = "logits_to_keep" in params
            if lead is None:
                self.cache.begin_prefill(sp.layout, n, padded, pos)
                self.last_owner, self.last_index = _holder(sp.layout, padded, n - 1)
                if self.kept_rows:
                    index = self.last_index if sp.rank == self.last_owner else 0
                    kwargs["logits_to_keep"] = torch.tensor([index], device=ids.device)
            else:
                lengths = n - lead
                self.cache.begin_prefill(sp.layout, n, padded, pos, lengths)
                # this rank's local index of each row's last real token (global index L_b - 1), -1: another rank's
                hit = pos[None, :] == (lengths - 1)[:, None]                        # [b, local]
                here = hit.any(1)
                self.row_index = torch.where(here, hit.to(torch.int64).argmax(1), torch.full_like(lengths, -1))
                if self.kept_rows:               # the distinct local rows this rank computes logits for
                    kept = torch.unique(self.row_index[here]) if bool(here.any()) else self.row_index.new_zeros(1)
                    kwargs["logits_to_keep"] = kept
                    self.row_index = torch.where(here, torch.searchsorted(kept, self.row_index), self.row_index)
        else:                                    # decode: one token, whole on every rank
            if ids.shape[1] != 1:
                raise UnsupportedModelError(f"ds_seqpar.hf: a decode step of {ids.shape[1]} tokens; the "
                                            f"sequence-sharded cache decodes one token per step")
            self.position = self.cache.begin_decode()
            if self.cache.lengths is None:
                kwargs["position_ids"] = torch.full((b, 1), self.position, dtype=torch.long, device=ids.device)
            else:                                # each row's own: L_b + steps (the unsharded cumsum(mask) - 1)
                self.row_position = self.cache.row_positions_of(torch.tensor([self.position], device=ids.device))[:, 0]
                kwargs["position_ids"] = self.row_position[:, None]
            self.step_ids = ids[:, 0]
            self.checked = False
            if self.linear is not None:          # the layers' own recurrent step on the replicated states
                self.linear.decoding, self.linear.documents = True, None
        return kwargs

    def end_linear(self) -> None:
        """The hybrid's mixers back to training's routing (after every forward, and when generate ends)."""
        if self.linear is not None:
            self.linear.prefill, self.linear.decoding, self.linear.documents = None, False, None

    def post_forward(self, output):
        """Prefill: every rank gets the last prompt token's logits from the rank that holds it."""
        if self.cache.phase == "prefill" and self.row_index is not None:     # left padding: per row
            logits, index = output.logits, self.row_index
            here = index >= 0
            rows = logits[torch.arange(logits.shape[0], device=logits.device), index.clamp(min=0)]   # [b, vocab]
            rows = torch.where(here.to(rows.device)[:, None], rows, torch.zeros_like(rows))
            output.logits = comm.all_reduce(rows[:, None].contiguous(), self.sp.group, self.sp.stats,
                                            kind="prefill_logits")
        elif self.cache.phase == "prefill":
            logits = output.logits
            if not self.kept_rows:                    # the model computed every local row: the holder's one
                logits = logits[:, self.last_index:self.last_index + 1]
            logits = logits.contiguous() if self.sp.rank == self.last_owner else torch.zeros_like(logits)
            output.logits = comm.all_reduce(logits, self.sp.group, self.sp.stats, kind="prefill_logits")
        self.cache.end_step()
        self.end_linear()
        return output

    def decode_attention(self, module, query, key, value, scaling, kwargs):
        """A decode step's attention in ``module``: query [b, h, 1, d] in, [b, 1, h, dv] out. ``key`` / ``value``
        [b, hkv, m, d]: what the layer made of the cache's answer (its own shard, in the order of the layer's
        positions; MLA caches latents and expands them here)."""
        layer = self.cache.layers[module.layer_idx]
        window = kwargs.get("sliding_window")
        window = None if window is None else int(window)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        checks = None if self.checked else self.step_ids
        self.checked = True
        if key.shape[2] != layer.positions.numel():
            raise UnsupportedModelError(f"ds_seqpar.hf: {type(module).__name__} attends over {key.shape[2]} keys but "
                                        f"its cache shard holds {layer.positions.numel()}: this layer does not attend "
                                        f"over what the cache returns; generate on one process")
        padded = layer.row_positions is not None          # left padding: each row's positions, PAD masked
        key_pos = layer.row_positions if padded else layer.positions
        q_pos = self.row_position if padded else self.position
        out = self.sp.strategy.decode(query[:, :, 0], key, value, key_pos, q_pos,
                                      float(scale), window, kwargs.get("softcap"), kwargs.get("s_aux"), checks)
        layer.trim(window, self.position + 1)
        return out.unsqueeze(1)

    def after_prefill_attention(self, module, kwargs) -> None:
        """A sliding-window layer keeps only what the first generated token can see."""
        window = kwargs.get("sliding_window")
        if window is not None:
            self.cache.layers[module.layer_idx].trim(int(window), self.cache.prompt_len)


def _holder(layout, padded: int, position: int):
    """(rank, local index) of the global ``position`` under ``layout``."""
    for r in range(layout.size):
        hit = (layout.indices(padded, r) == position).nonzero()
        if hit.numel():
            return r, int(hit[0, 0])
    raise AssertionError(position)


def install(model, state) -> None:
    """Replace ``model.generate`` (instance attribute; remove_sequence_parallel restores it)."""
    own = model.__dict__.get("generate")
    setattr(model, GENERATE_ATTR, own)
    original = own if own is not None else type(model).generate.__get__(model)

    def generate(*args, **kwargs):
        return sharded_generate(model, state, original, args, kwargs)

    model.generate = generate


def restore(model) -> None:
    own = model.__dict__.pop(GENERATE_ATTR, None)
    model.__dict__.pop("generate", None)
    if own is not None:
        model.generate = own


def sharded_generate(model, state, original, args, kwargs):
    from .kv_cache import ShardedKVCache
    name = type(model).__name__
    check_model(model, state)
    sp = state.sp
    given = kwargs.get("generation_config", args[1] if len(args) > 1 else None)     # generate(inputs, config, ...)
    gen = copy.deepcopy(given or model.generation_config)
    gen.update(**{k: v for k, v in kwargs.items() if k != "generation_config"})
    check_options(name, gen, kwargs)
    ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    if not torch.is_tensor(ids) or ids.dim() != 2:
        raise UnsupportedModelError(f"ds_seqpar.hf: {name}.generate under sequence parallelism needs input_ids "
                                    f"[batch, tokens] (the same prompt on every rank of the group)")
    mask = kwargs.get("attention_mask")
    check_agreement(sp, name, ids, mask, gen)             # the first collective
    check_left_padding(name, ids, mask)
    padded = mask is not None and not bool((mask == 1).all())
    if padded:                                            # the mask agrees on every rank now
        check_model(model, state, left_padded=True)
    config = text_config(model)
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    states = [idx for _, _, idx in state.linear.layer_info] if state.linear is not None else []
    cache = ShardedKVCache(config.num_hidden_layers, [t == "sliding_attention" for t in layer_types], sp.size, sp.rank,
                           states, sp.group, sp.stats, {getattr(m, "layer_idx", None) for _, m in state.layers})
    run = state.generation = GenerationRun(sp, cache, padded=padded, linear=state.linear)
    try:
        out = original(*args, **dict(kwargs, use_cache=True, **{cache_argument(model): cache}))
    finally:
        state.generation = None
        run.end_linear()
    sequences = out if torch.is_tensor(out) else out.sequences
    same = _same_on_ranks(sp, [_crc(sequences)])
    if not same[0]:
        raise RuntimeError(f"ds_seqpar.hf: {name}.generate produced different tokens on the ranks of a sequence "
                           f"group; run it with the same prompt, options and random seed on every rank")
    return out


def cache_argument(model) -> str:
    """The name the model's forward takes its cache by: past_key_values, or cache_params (Mamba, Falcon-Mamba,
    Mamba2: models without attention layers)."""
    import inspect
    params = inspect.signature(model.forward).parameters
    return "cache_params" if "cache_params" in params and "past_key_values" not in params else "past_key_values"


__all__ = ["install", "restore", "GenerationRun", "GENERATE_ATTR"]
