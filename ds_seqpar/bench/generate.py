"""``ds-seqpar bench generate``: model.generate with a sequence-sharded KV cache on 2 local CPU ranks (gloo,
one thread each; not a test), against the unapplied model on one process (P=1), interleaved round by round.

At each context length ``--lengths`` (the prompt), one generate call per case and round of 1 + ``--steps``
new tokens (greedy) of a tiny Hugging Face Llama; a logits processor stamps the wall and thread CPU clocks
at every step, so one call gives
  * the prefill time (the call's start to the first token's logits: prompt through the strategy, the
    agreement check, the logits of the last prompt token);
  * the decode time per token (the median gap between later steps: one token through every layer, one
    all-gather merge per layer);
and, after it, each rank's KV-cache bytes against the unsharded cache's, and the merge's bytes on the wire
against cost/decode.py's closed form.

Decode where attention over the cache counts (``--decode_contexts``): the tiny model's attention is a few
thousand operations per key, so at any length one collective per layer outweighs it. These rows time one
decode step of one layer with Llama-3-8B's sizes (hidden 4096, 32 heads / 8 KV heads of 128, MLP 14336)
over a cache of N tokens filled directly (seeded random K/V: a decode step's time does not depend on the
values; a prefill at 64K tokens of this width would take hours on CPU). P=2 runs the applied model's real
decode path (hf/generate.py's routing, the sharded cache, the all-gather merge); P=1 transformers' own over
a DynamicCache holding the same K/V; both decode greedily and must produce the same tokens.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Any, Dict, List

import torch

from .. import comm
from ..report.rows import Row
from .harness import command_line, machine_facts, measure_on_pool, suite_facts, suite_main, suite_parser, write_page

PROG = "ds-seqpar bench generate"
PREFILL, DECODE = "prefill speedup, P=2 vs 1", "decode time per token, P=1 / P=2"
CACHE, MERGE = "KV cache bytes per rank / unsharded", "decode merge bytes per step"
SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=256)
WIDE = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=1, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=256)          # one layer of Llama-3-8B (a small vocabulary)
FILLED = "decode time per token over a filled cache, P=1 / P=2"


def tiny_llama(max_len: int, shape: Dict[str, int] = SHAPE):
    import transformers as T
    config = T.LlamaConfig(**shape, max_position_embeddings=max_len, attention_dropout=0.0, pad_token_id=0,
                           eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def _filled_kv(n: int, batch: int, layer: int):
    """The seeded K/V [b, hkv, n, d] of ``layer`` over n tokens (the same on every rank and for P=1)."""
    g = torch.Generator().manual_seed(1000 * layer + n)
    dims = (batch, WIDE["num_key_value_heads"], n, WIDE["hidden_size"] // WIDE["num_attention_heads"])
    return torch.randn(dims, generator=g), torch.randn(dims, generator=g)


def _decode_steps(model, cache, n: int, batch: int, steps: int, position: bool):
    """``steps`` greedy decode forwards after n cached tokens: (tokens [b, steps], median wall, median CPU)."""
    tok = torch.ones(batch, 1, dtype=torch.long)
    tokens, gaps = [], []
    with torch.no_grad():
        for t in range(steps):
            kwargs = {"position_ids": torch.full((batch, 1), n + t)} if position else {}
            w, c = time.perf_counter(), time.thread_time()
            out = model(input_ids=tok, past_key_values=cache, use_cache=True, **kwargs)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            gaps.append((time.perf_counter() - w, time.thread_time() - c))
            tokens.append(tok)
    return torch.cat(tokens, 1), statistics.median(g[0] for g in gaps), statistics.median(g[1] for g in gaps)


def filled_decode(model, sp, n: int, batch: int, steps: int):
    """One decode run over a cache of n tokens filled directly: P=1 (``sp`` None, transformers' DynamicCache)
    or this rank's share of the applied ``model``'s sharded cache, decoded through hf/generate.py's routing."""
    from transformers import DynamicCache
    from ..hf.apply import STATE_ATTR
    from ..hf.generate import GenerationRun
    from ..hf.kv_cache import ShardedKVCache
    layers = model.config.num_hidden_layers
    if sp is None:
        cache = DynamicCache()
        for i in range(layers):
            cache.update(*_filled_kv(n, batch, i), i)
        return _decode_steps(model, cache, n, batch, steps, position=True)
    cache = ShardedKVCache(layers, [False] * layers, sp.size, sp.rank)
    pos = sp.position_ids(n)
    cache.begin_prefill(sp.layout, n, sp.padded_len(n), pos)
    for i, layer in enumerate(cache.layers):
        k, v = _filled_kv(n, batch, i)
        keep = pos.clamp(max=n - 1)              # the layout's end padding: dropped by the cache (pos >= n)
        layer.update(k[:, :, keep], v[:, :, keep])
    cache.end_step()
    state = getattr(model, STATE_ATTR)
    state.generation = GenerationRun(sp, cache)
    try:
        return _decode_steps(model, cache, n, batch, steps, position=False)
    finally:
        state.generation = None


class Stamps:
    """A logits processor that records (wall, thread CPU) at every step and changes nothing."""

    def __init__(self):
        self.times: List[tuple] = []

    def __call__(self, input_ids, scores):
        self.times.append((time.perf_counter(), time.thread_time()))
        return scores


def _one(model, prompt, steps: int):
    from transformers import LogitsProcessorList
    stamps = Stamps()
    start = (time.perf_counter(), time.thread_time())
    with torch.no_grad():
        out = model.generate(input_ids=prompt, max_new_tokens=1 + steps, do_sample=False, return_dict_in_generate=True,
                             logits_processor=LogitsProcessorList([stamps]))
    t = stamps.times
    gaps = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(t, t[1:])]
    return out, {"prefill": (t[0][0] - start[0], t[0][1] - start[1]),
                 "decode": (statistics.median(g[0] for g in gaps), statistics.median(g[1] for g in gaps))}


def _rank(args) -> Dict[str, Any]:
    from ..hf import apply_sequence_parallel
    from ..sequence_parallel import SequenceParallel
    sp = SequenceParallel({"strategy": args.strategy, "size": 2})
    lengths = [int(x) for x in args.lengths.split(",")]
    plain = tiny_llama(max(lengths) + args.steps + 8) if sp.rank == 0 else None
    sharded = apply_sequence_parallel(tiny_llama(max(lengths) + args.steps + 8), sp)
    result = {"rank": sp.rank, "lengths": {}}
    for n in lengths:
        prompt = torch.randint(1, SHAPE["vocab_size"], (1, n), generator=torch.Generator().manual_seed(n))
        times = {"P=1": [], "P=2": []}
        for rnd in range(args.warmup + args.repeats):
            for case in ("P=2", "P=1"):
                comm.barrier(sp.group)
                if case == "P=2":
                    sp.stats.reset()
                    out, t = _one(sharded, prompt, args.steps)
                    merge = sp.stats.bytes["decode_merge"] // args.steps
                    cache = out.past_key_values.local_bytes()
                    tokens = out.past_key_values.shares[sp.rank]
                    sequences = out.sequences
                elif plain is not None:
                    ref, t = _one(plain, prompt, args.steps)
                    same = torch.equal(ref.sequences, sequences)
                else:
                    continue
                if rnd >= args.warmup:
                    times[case].append(t)
        result["lengths"][n] = {"times": times, "merge_bytes": merge, "cache_bytes": cache, "tokens": tokens,
                                "same_tokens": same if sp.rank == 0 else None}
    contexts = _ints(args.decode_contexts)
    if contexts:
        del plain, sharded
        wide_plain = tiny_llama(max(contexts) + args.steps + 8, WIDE) if sp.rank == 0 else None
        wide = apply_sequence_parallel(tiny_llama(max(contexts) + args.steps + 8, WIDE), sp)
        result["filled"] = {}
        for n, batch in _filled_cases(args):
            times = {"P=1": [], "P=2": []}
            for rnd in range(args.warmup + args.repeats):
                for case in ("P=2", "P=1"):
                    comm.barrier(sp.group)
                    if case == "P=2":
                        tokens, wall, cpu = filled_decode(wide, sp, n, batch, args.steps)
                    elif wide_plain is not None:
                        ref, wall, cpu = filled_decode(wide_plain, None, n, batch, args.steps)
                        same = torch.equal(ref, tokens)
                    else:
                        continue
                    if rnd >= args.warmup:
                        times[case].append((wall, cpu))
            result["filled"][(n, batch)] = {"times": times, "same_tokens": same if sp.rank == 0 else None}
    result["load_1min"] = os.getloadavg()[0]
    return result


def _ints(text: str) -> List[int]:
    return [int(x) for x in text.split(",") if x]


def _filled_cases(args) -> List[tuple]:
    """(context, batch) of the filled-cache rows: those with batch x context <= --decode_max_tokens (the
    unsharded GQA layer expands its K/V to every query head: 4 KiB per token and head group on P=1)."""
    return [(n, b) for b in _ints(args.decode_batch) for n in _ints(args.decode_contexts)
            if n * b <= args.decode_max_tokens]


def _filled_rows(n, batch, per_rank, args) -> List[Row]:
    """Decode over a filled cache: P=1's step time over the slowest P=2 rank's, per round (CPU: the busiest)."""
    one = next(r for r in per_rank if r["rank"] == 0)["filled"][(n, batch)]
    two = [r["filled"][(n, batch)]["times"]["P=2"] for r in per_rank]
    walls = [one["times"]["P=1"][i][0] / max(t[i][0] for t in two) for i in range(args.repeats)]
    cpus = [one["times"]["P=1"][i][1] / max(t[i][1] for t in two) for i in range(args.repeats)]
    return [Row("generate", "decode, filled cache", f"N={n} b={batch}", FILLED, "x",
                statistics.median(walls), (min(walls), max(walls)),
                target="generate.decode" if n >= 16384 else None,
                detail={"cpu_ratio": statistics.median(cpus), "same_tokens_as_P1": one["same_tokens"],
                        "p1_s": statistics.median(x[0] for x in one["times"]["P=1"]),
                        "p2_s": statistics.median(max(t[i][0] for t in two) for i in range(args.repeats)),
                        "p1_cpu_s": statistics.median(x[1] for x in one["times"]["P=1"]),
                        "p2_busiest_cpu_s": statistics.median(max(t[i][1] for t in two) for i in range(args.repeats))})]


def _ratio_rows(n, per_rank, args) -> List[Row]:
    """Prefill and decode: P=1 (rank 0) over the slowest rank at P=2, per round; CPU: the busiest rank's."""
    one = next(r for r in per_rank if r["rank"] == 0)["lengths"][n]["times"]["P=1"]
    two = [r["lengths"][n]["times"]["P=2"] for r in per_rank]
    rows = []
    for phase, metric, target, bound in (("prefill", PREFILL, "generate.prefill", 2.0),
                                         ("decode", DECODE, "generate.decode" if n >= 16384 else None, None)):
        walls = [one[i][phase][0] / max(t[i][phase][0] for t in two) for i in range(args.repeats)]
        cpus = [one[i][phase][1] / max(t[i][phase][1] for t in two) for i in range(args.repeats)]
        rows.append(Row("generate", phase, f"N={n}", metric, "x", statistics.median(walls), (min(walls), max(walls)),
                        bound=bound, target=target,
                        detail={"cpu_ratio": statistics.median(cpus),
                                "p1_s": statistics.median(x[phase][0] for x in one),
                                "p2_s": statistics.median(max(t[i][phase][0] for t in two) for i in range(args.repeats)),
                                "p1_cpu_s": statistics.median(x[phase][1] for x in one),
                                "p2_busiest_cpu_s": statistics.median(max(t[i][phase][1] for t in two)
                                                                      for i in range(args.repeats))}))
    return rows


def measure(args, argv: List[str]) -> int:
    from ..cost import decode_step_bytes, kv_cache_bytes
    args.P = 2
    per_rank, meta = measure_on_pool(_rank, args, command_line(PROG, argv), versions=True)
    head = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
    rows = []
    for n in [int(x) for x in args.lengths.split(",")]:
        rows += _ratio_rows(n, per_rank, args)
        tokens = n + args.steps            # the last token's K/V is never computed
        whole = kv_cache_bytes(tokens, SHAPE["num_hidden_layers"], 1, SHAPE["num_key_value_heads"], head, head, 4)
        mine = [r["lengths"][n] for r in sorted(per_rank, key=lambda r: r["rank"])]
        per_token = whole // tokens
        rows.append(Row("generate", "kv cache", f"N={n}", CACHE, "x", [m["cache_bytes"] / whole for m in mine],
                        predicted=[m["tokens"] * per_token / whole for m in mine], target="bytes",
                        detail={"unsharded_bytes": whole, "rank_bytes": [m["cache_bytes"] for m in mine],
                                "rank_tokens": [m["tokens"] for m in mine]}))
        rows.append(Row("generate", "merge", f"N={n}", MERGE, "B", [m["merge_bytes"] for m in mine],
                        predicted=decode_step_bytes(2, SHAPE["num_hidden_layers"], 1, SHAPE["num_attention_heads"],
                                                    head), target="bytes",
                        detail={"same_tokens_as_P1": mine[0]["same_tokens"]}))
    for n, batch in _filled_cases(args):
        rows += _filled_rows(n, batch, per_rank, args)
    meta.update(machine_facts())
    facts = suite_facts(
        meta, "Generation with a sequence-sharded KV cache",
        f"A tiny Llama (hidden 64, 2 layers, 4 heads / 2 KV heads, vocab 256, fp32, sdpa) generating 1 + {args.steps} "
        f"greedy tokens from a prompt of N tokens: {args.strategy} at P=2 (2 ranks x 1 thread, gloo; the prompt "
        f"through the strategy, then one token per step merged across the ranks) vs the unapplied model on one "
        f"process (P=1, transformers' DynamicCache).",
        {PREFILL: "P=1 prefill time / the slowest rank's at P=2 (bound 2); the call's start to the first logits",
         DECODE: "P=1 median time between steps / the slowest rank's at P=2 (above 1: P=2 is faster)",
         CACHE: "each rank's K/V bytes after the call over the unsharded cache's; predicted: its share of the tokens",
         MERGE: "bytes a rank sends per decode step in the merges; predicted: cost/decode.py decode_step_bytes",
         FILLED: "one layer of Llama-3-8B's sizes over a cache of N tokens filled directly (module doc): P=1's "
                 "median step time over the slowest P=2 rank's, per round (above 1: P=2 is faster)"},
        rounds=True)
    return write_page(args.out, args.name, rows, dict(facts, meta=meta), PROG)


def parser():
    ap = suite_parser(PROG, __doc__, "generate_cpu", repeats=3)
    ap.add_argument("--strategy", default="zigzag")
    ap.add_argument("--lengths", default="2048,8192,16384", help="prompt lengths, comma-separated")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per call")
    ap.add_argument("--decode_contexts", default="4096,16384,65536",
                    help="cached tokens of the filled-cache decode rows (one Llama-3-8B layer), comma-separated; "
                         "empty: none")
    ap.add_argument("--decode_batch", default="1,4",
                    help="rows decoded at once in the filled-cache rows (a rollout batch decodes many), comma-separated")
    ap.add_argument("--decode_max_tokens", type=int, default=65536,
                    help="filled-cache cases with batch x context above this are skipped (memory of the P=1 side)")
    return ap


def main(argv=None) -> int:
    return suite_main(argv, parser(), measure)


__all__ = ["main", "tiny_llama"]
