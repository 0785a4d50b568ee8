"""``ds-seqpar bench posttrain``: post-training's per-token log-prob path on 2 local CPU ranks (gloo, one
thread each; not a test).

Two parts:
  * speed: a GRPO step after its rollouts (grpo_step: TRL's scoring of left-padded rows and its clipped loss
    with KL), and a DPO step as TRL's DPOTrainer computes it under ``sequence_parallel(DPOTrainer)`` (the policy's
    fused-head forward and backward and the reference's forward, both through the whole-row scoring of
    hf/trl_rows.py; then -logsigmoid(beta x margin)) on one preference pair of ``--seq``-token rows of a tiny
    Hugging Face Llama, at P=2 against the same step on one process (P=1, the unapplied models), interleaved
    round by round;
  * memory: one rank's log-prob path at ``--memory-seq`` tokens per sequence (P=2: half of them per rank) and a
    ``--vocab`` vocabulary: the peak above static (memory/usage.py: VmHWM) of
    ``sp.token_logprobs_from_hidden`` (chunks of ``--chunk`` rows) and of the plain path that materialises the
    [tokens, vocab] logits and their log-softmax, forward + backward each, one rank at a time.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any, Dict, List

import torch
import torch.nn.functional as F

from .. import comm
from ..report.rows import Row
from .harness import command_line, machine_facts, measure_on_pool, median_ratio, ratio_range, suite_facts, \
    suite_main, suite_parser, write_page

PROG = "ds-seqpar bench posttrain"
SPEED_GRPO = "GRPO step after the rollouts, speedup P=2 vs 1"
TRL_DEFAULT_TILE = 32768      # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE in TRL 1.16 (its fused head's tile)
BETA = 0.1
SPEED, MEMORY, MEMORY_CHUNK = "DPO step speedup, P=2 vs 1", "log-prob path: peak above static", \
    "log-prob path: peak above static / one chunk of fp32 logits"


def tiny_llama(vocab: int, seed: int = 0):
    import transformers as T
    from trl.trainer.utils import add_fused_lm_head
    config = T.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=65536,
                           attention_dropout=0.0, use_cache=False, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    return model


def dpo_step(policy, ref, ids, labels, scoring) -> float:
    """One DPO step's compute (TRL's _compute_loss, sigmoid loss); returns the loss."""
    with scoring.scoring([policy, ref]) if scoring is not None else nullcontext():
        out = policy(input_ids=ids, labels=labels, fused_lm_head=True)
        with torch.no_grad():
            ref_out = ref(input_ids=ids, labels=labels, fused_lm_head=True)
    chosen, rejected = (out.log_probs.sum(1) - ref_out.log_probs.sum(1)).chunk(2)
    loss = -F.logsigmoid(BETA * (chosen - rejected)).mean()
    loss.backward()
    policy.zero_grad(set_to_none=True)
    return loss.item()


def grpo_step(policy, ref, ids, mask, labels, scoring, keep: int) -> float:
    """One GRPO step's compute after the rollouts (TRL's _compute_loss with beta 0.04 and the old policy's
    log-probs): old-policy and reference forwards, the policy's forward + backward, clipped ratios and the k3
    KL over the last ``keep`` positions (the completions); rows are a left-padded prompt + the completion.
    Returns the completions' summed log-probs (the loss itself is 0 at a first step: ratios 1, no KL)."""
    with scoring.scoring([policy, ref]) if scoring is not None else nullcontext():
        with torch.no_grad():
            old = policy(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs[:, -keep:]
            ref_logp = ref(input_ids=ids, attention_mask=mask, labels=labels,
                           fused_lm_head=True).log_probs[:, -keep:]
        logp = policy(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs[:, -keep:]
    completion = (labels[:, -keep:] != -100).float()
    advantages = torch.tensor([[1.0], [-1.0]])
    ratio = torch.exp(logp - old)
    per_token = -torch.min(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
    kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
    loss = (((per_token + 0.04 * kl) * completion).sum(1) / completion.sum(1)).mean()
    loss.backward()
    policy.zero_grad(set_to_none=True)
    return (logp.detach() * completion).sum().item()


def _grpo_rows(seq: int, g):
    """Two rows of ``seq`` tokens: a prompt left-padded by 1/16 of the row, then a completion of 1/2 of it."""
    ids = torch.randint(2, 256, (2, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[:, :seq // 16] = 0
    ids[:, :seq // 16] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-seq // 2] = -100
    return ids, mask, labels, seq // 2


def _speed(args) -> Dict[str, Any]:
    from ..hf import apply_sequence_parallel
    from ..hf.trl_rows import WholeRowScoring
    from ..sequence_parallel import SequenceParallel
    sp = SequenceParallel({"strategy": args.strategy, "size": 2})
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 256, (2, args.seq), generator=g)           # [chosen; rejected], one pair
    labels = ids.clone()
    labels[:, :args.seq // 8] = -100                                   # the prompt
    plain = (tiny_llama(256), tiny_llama(256)) if sp.rank == 0 else None
    sharded = tuple(apply_sequence_parallel(tiny_llama(256), sp) for _ in range(2))
    scoring = WholeRowScoring(sp, "DPOTrainer")
    rows = _grpo_rows(args.seq, g)
    cases = ("P=1", "P=2", "GRPO P=1", "GRPO P=2")
    walls = {case: [] for case in cases}
    cpus = {case: [] for case in cases}
    losses = {}
    for round_ in range(args.warmup + args.repeats):
        for case in cases:
            comm.barrier(sp.group)
            t0, c0 = time.perf_counter(), time.thread_time()
            if case == "P=2":
                losses[case] = dpo_step(*sharded, ids, labels, scoring)
            elif case == "GRPO P=2":
                losses[case] = grpo_step(*sharded, *rows[:3], scoring, rows[3])
            elif plain is not None:
                losses[case] = dpo_step(*plain, ids, labels, None) if case == "P=1" else \
                    grpo_step(*plain, *rows[:3], None, rows[3])
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
            if round_ >= args.warmup:
                walls[case].append(wall)
                cpus[case].append(cpu)
    return {"rank": sp.rank, "wall": walls, "cpu": cpus, "losses": losses}


def _memory(args) -> Dict[str, Any]:
    from ..memory.usage import StepMemory
    from ..sequence_parallel import SequenceParallel
    sp = SequenceParallel({"strategy": args.strategy, "size": 2})
    g = torch.Generator().manual_seed(2)
    hidden = sp.shard(torch.randn(1, args.memory_seq, 64, generator=g))
    weight = torch.randn(args.vocab, 64, generator=g) * 0.05
    labels = sp.shard(torch.randint(0, args.vocab, (1, args.memory_seq), generator=g))
    out = {"rank": sp.rank}

    def fused():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp, ent = sp.token_logprobs_from_hidden(h, w, labels, entropy=True, chunk_tokens=args.chunk)
        (sp.sequence_sum(logp, grad_scale=1.0).sum() + 0.01 * ent.sum()).backward()

    def full():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp_all = F.log_softmax(F.linear(h, w).float(), dim=-1)                        # [1, local, V]
        logp = logp_all.gather(-1, labels[..., None]).squeeze(-1)
        ent = -(logp_all.exp() * logp_all).sum(-1)
        (sp.sequence_sum(logp, grad_scale=1.0).sum() + 0.01 * ent.sum()).backward()

    def trl_head(tile):
        """TRL's fused LM head (the kernel of add_fused_lm_head) on this rank's tokens, ``tile`` rows at a time:
        what a GRPO / DPO step's scoring call runs, at TRL's own tile and at the one whole-row scoring sets."""
        from trl.kernels import ChunkedLogProbFunction

        def run():
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            logp, ent = ChunkedLogProbFunction.apply(h.reshape(-1, h.shape[-1]), w, None, labels.reshape(-1), 1.0,
                                                     tile, None, 1.0, ("log_probs", "entropy"))[:2]
            (sp.sequence_sum(logp.view(1, -1), grad_scale=1.0).sum() + 0.01 * ent.sum()).backward()
        return run

    paths = (("fused", fused), ("full logits", full), ("trl tile", trl_head(args.chunk)),
             ("trl default tile", trl_head(TRL_DEFAULT_TILE)))
    for name, fn in paths:
        for turn in range(sp.size):                 # one rank at a time: the plain path's peak is large
            comm.barrier(sp.group)
            if turn == sp.rank:
                fn()                                # warm: the allocator's pools and the ops' first call
                mem = StepMemory(torch.device("cpu"))
                mem.begin()
                mem.mark("logprobs")
                fn()
                out[name] = mem.end()["above_static_bytes"]
            else:                                   # join the measuring rank's collectives (two runs of fn)
                for _ in range(2):
                    sp.sequence_sum(torch.zeros(1, hidden.shape[1]), grad_scale=1.0)
    comm.barrier(sp.group)
    return out


def _rank(args) -> Dict[str, Any]:
    import os
    result = {"speed": _speed(args), "memory": _memory(args)}
    result["load_1min"] = os.getloadavg()[0]
    return result


def measure(args, argv: List[str]) -> int:
    import os
    from ..launch.env import restored_environ
    from .memory import MALLOC_ENV
    args.P = 2
    with restored_environ(*MALLOC_ENV):     # every block above 64 KiB mapped: the resident set follows live tensors
        os.environ.update(MALLOC_ENV)
        per_rank, meta = measure_on_pool(_rank, args, command_line(PROG, argv), versions=True)
    speed = [r["speed"] for r in per_rank]
    one = next(s for s in speed if s["rank"] == 0)
    slowest = [max(s["wall"]["P=2"][i] for s in speed) for i in range(args.repeats)]
    busiest = [max(s["cpu"]["P=2"][i] for s in speed) for i in range(args.repeats)]
    rows = [Row("posttrain", "dpo", f"N={args.seq}", SPEED, "x", median_ratio(one["wall"]["P=1"], slowest),
                tuple(ratio_range(one["wall"]["P=1"], slowest)), bound=2.0, target="posttrain.dpo",
                detail={"cpu_ratio": median_ratio(one["cpu"]["P=1"], busiest),
                        "p1_s": sorted(one["wall"]["P=1"])[len(slowest) // 2],
                        "p2_s": sorted(slowest)[len(slowest) // 2],
                        "loss_p1": one["losses"]["P=1"], "loss_p2": one["losses"]["P=2"]})]
    slowest = [max(s["wall"]["GRPO P=2"][i] for s in speed) for i in range(args.repeats)]
    busiest = [max(s["cpu"]["GRPO P=2"][i] for s in speed) for i in range(args.repeats)]
    rows.append(Row("posttrain", "grpo", f"N={args.seq}", SPEED_GRPO, "x",
                    median_ratio(one["wall"]["GRPO P=1"], slowest), tuple(ratio_range(one["wall"]["GRPO P=1"], slowest)),
                    bound=2.0, target="posttrain.grpo",
                    detail={"cpu_ratio": median_ratio(one["cpu"]["GRPO P=1"], busiest),
                            "p1_s": sorted(one["wall"]["GRPO P=1"])[len(slowest) // 2],
                            "p2_s": sorted(slowest)[len(slowest) // 2],
                            "logp_sum_p1": one["losses"]["GRPO P=1"], "logp_sum_p2": one["losses"]["GRPO P=2"]}))
    chunk_bytes = args.chunk * args.vocab * 4
    for r in per_rank:
        m = r["memory"]
        local = args.memory_seq // 2
        rows.append(Row("posttrain", "logprobs", f"rank {m['rank']}, fused chunk {args.chunk}", MEMORY, "B",
                        m["fused"], detail={"tokens_per_rank": local, "vocab": args.vocab}))
        rows.append(Row("posttrain", "logprobs", f"rank {m['rank']}, full logits", MEMORY, "B", m["full logits"],
                        predicted=local * args.vocab * 4, detail={"tokens_per_rank": local, "vocab": args.vocab}))
        rows.append(Row("posttrain", "grpo_scoring", f"rank {m['rank']}, TRL head, tile {args.chunk} (sequence "
                        f"parallel)", MEMORY, "B", m["trl tile"], detail={"tokens_per_rank": local, "vocab": args.vocab}))
        rows.append(Row("posttrain", "grpo_scoring", f"rank {m['rank']}, TRL head, its tile {TRL_DEFAULT_TILE}",
                        MEMORY, "B", m["trl default tile"], predicted=min(local, TRL_DEFAULT_TILE) * args.vocab * 4,
                        detail={"tokens_per_rank": local, "vocab": args.vocab}))
        rows.append(Row("posttrain", "logprobs", f"rank {m['rank']}, fused chunk {args.chunk}", MEMORY_CHUNK, "x",
                        m["fused"] / chunk_bytes, target="posttrain.logprob_chunks",
                        detail={"chunk_bytes": chunk_bytes, "full_over_fused": m["full logits"] / max(m["fused"], 1)}))
    meta.update(machine_facts())
    facts = suite_facts(
        meta, "Post-training: the DPO step and the log-prob path",
        f"Speed: a DPO step (policy fused-head forward + backward, reference forward, sigmoid loss) of a tiny "
        f"Llama (hidden 64, 2 layers, 4 heads / 2 KV heads, vocab 256) on one pair of {args.seq}-token rows, "
        f"{args.strategy} at P=2 (2 ranks x 1 thread, gloo) vs the unapplied models on one process (P=1). Memory: "
        f"{args.memory_seq} tokens per sequence ({args.memory_seq // 2} per rank), vocab {args.vocab}, hidden 64, "
        f"fp32, forward + backward of the log-probs and entropies, one rank at a time; the ranks map every block "
        f"above 64 KiB (MALLOC_MMAP_THRESHOLD_=65536: the resident set follows live tensors).",
        {SPEED: "P=1 wall time / the slowest rank's wall time at P=2, per round (bound 2)",
         SPEED_GRPO: "the same ratio for a GRPO step after its rollouts (old-policy and reference forwards, the "
                     "policy's forward + backward, clipped ratios + KL) on two left-padded rows of N tokens, half "
                     "of them completion; rollouts generate on whole prompts and are not in it",
         MEMORY: "the path's peak resident bytes above what the rank held before it (VmHWM); predicted: one "
                 "fp32 [tokens, vocab] tensor",
         MEMORY_CHUNK: "the fused path's peak above static over one chunk of fp32 logits (chunk x vocab x 4 B)",
         "grpo_scoring": "TRL's fused LM head kernel (what GRPO's and DPO's scoring calls run) on the rank's "
                         "tokens, at the tile whole-row scoring sets (--chunk) and at TRL's own tile; one plain "
                         "process scoring the whole sequence holds min(tokens, TRL's tile) rows"},
        rounds=True)
    return write_page(args.out, args.name, rows, dict(facts, meta=meta), PROG)


def parser():
    ap = suite_parser(PROG, __doc__, "posttrain_cpu", repeats=5, seq=8192)
    ap.add_argument("--strategy", default="zigzag")
    ap.add_argument("--memory-seq", type=int, default=32768)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=1024)
    return ap


def main(argv=None) -> int:
    return suite_main(argv, parser(), measure)


__all__ = ["main", "dpo_step", "tiny_llama"]
