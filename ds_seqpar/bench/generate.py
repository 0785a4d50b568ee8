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


def tiny_llama(max_len: int):
    import transformers as T
    config = T.LlamaConfig(**SHAPE, max_position_embeddings=max_len, attention_dropout=0.0, pad_token_id=0,
                           eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


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
    result["load_1min"] = os.getloadavg()[0]
    return result


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
         MERGE: "bytes a rank sends per decode step in the merges; predicted: cost/decode.py decode_step_bytes"},
        rounds=True)
    return write_page(args.out, args.name, rows, dict(facts, meta=meta), PROG)


def parser():
    ap = suite_parser(PROG, __doc__, "generate_cpu", repeats=3)
    ap.add_argument("--strategy", default="zigzag")
    ap.add_argument("--lengths", default="2048,8192,16384", help="prompt lengths, comma-separated")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per call")
    return ap


def main(argv=None) -> int:
    return suite_main(argv, parser(), measure)


__all__ = ["main", "tiny_llama"]
