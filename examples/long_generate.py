"""Needle in a haystack: train a tiny model sequence-parallel, then generate over a sequence-sharded KV cache.

    deepspeed --num_gpus 2 examples/long_generate.py --deepspeed configs/trainer/zigzag_zero2.json

A 1-layer Llama-architecture model from a config (no hub) learns to answer a query marker with the token
that followed the needle marker somewhere in a haystack of filler ([..., NEEDLE, n, ..., QUERY] -> n).
Training is the own-loop recipe (apply_sequence_parallel, sp.shard_batch, the engine's loss = sp.loss)
with the strategy and ZeRO stage of the JSON (its "auto" values filled by this script, as the Trainer
would). Then every rank prefills the same prompts, each with its needle on a rank other than the one
holding the query (the last prompt token), and decodes with ``model.generate``: no rank holds the whole
KV cache, so the answer has to come through the decode's merge over the ranks' shards. The script checks
the needles come back and that the greedy tokens equal the unsharded model's (the same weights on one
process, float32 and float64, which must agree), and exits non-zero otherwise
(tests/dist/test_long_generate.py runs the same functions on the 4-rank pool).
"""
import argparse
import json
import sys
import time

import torch

VOCAB, NEEDLE, QUERY, FIRST, NEEDLES = 64, 1, 2, 3, 8    # needle values FIRST .. FIRST + NEEDLES - 1; filler above
TRAIN_LENGTHS = (16, 64)        # each step's rows: one length drawn in this range (the same on every rank)
ROWS = 32                       # rows per step over all replicas
NEW = 4                         # tokens generated per prompt (the first is the answer)
AUTO = {"train_micro_batch_size_per_gpu": None, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0}
OPTIMIZER = {"lr": 8e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}


def tiny_config():
    """1 layer, hidden 32, GQA (4 query, 2 key/value heads), vocabulary 64."""
    import transformers as T
    return T.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, use_cache=False,
                         pad_token_id=0, bos_token_id=None, eos_token_id=None)


def tiny_model(dtype=torch.float32):
    import transformers as T
    return T.AutoModelForCausalLM.from_config(tiny_config(), attn_implementation="sdpa").to(dtype)


def haystack(g, length: int, needle_at=None):
    """One row of ``length`` tokens: filler, NEEDLE n at ``needle_at`` (drawn when None), QUERY n at the end.
    Returns (row, n)."""
    row = torch.randint(FIRST + NEEDLES, VOCAB, (length,), generator=g)
    n = int(torch.randint(FIRST, FIRST + NEEDLES, (1,), generator=g))
    at = int(torch.randint(0, length - 3, (1,), generator=g)) if needle_at is None else needle_at
    row[at], row[at + 1] = NEEDLE, n
    row[-2], row[-1] = QUERY, n
    return row, n


def step_rows(step: int):
    """The global batch of a step, the same on every rank: ROWS rows of one length; only the answer is a
    target (labels -100 elsewhere)."""
    g = torch.Generator().manual_seed(1000 + step)
    length = int(torch.randint(TRAIN_LENGTHS[0], TRAIN_LENGTHS[1] + 1, (1,), generator=g))
    ids = torch.stack([haystack(g, length)[0] for _ in range(ROWS)])
    labels = torch.full_like(ids, -100)
    labels[:, -1] = ids[:, -1]
    return ids, labels


def load(ds) -> dict:
    """A copy of the DeepSpeed JSON (a path or a dict)."""
    if not isinstance(ds, dict):
        with open(ds) as f:
            return json.load(f)
    return json.loads(json.dumps(ds))


def resolve(ds, dp_size: int) -> dict:
    """The DeepSpeed JSON (path or dict) with "auto" values filled in (the Trainer fills them from its
    arguments; this loop from the constants above); no train_batch_size (DeepSpeed derives it from the mpu)."""
    ds = load(ds)
    auto = dict(AUTO, train_micro_batch_size_per_gpu=ROWS // dp_size)
    for key, value in auto.items():
        if ds.get(key, "auto") == "auto":
            ds[key] = value
    ds.pop("train_batch_size", None)
    params = ds.setdefault("optimizer", {"type": "AdamW", "params": {"torch_adam": True}}).setdefault("params", {})
    for key, value in OPTIMIZER.items():
        if params.get(key, "auto") == "auto":
            params[key] = value
    ds.pop("scheduler", None)         # a constant learning rate: the loop is short
    return ds


def train(ds, steps: int = 100):
    """Train on every rank (sequence-parallel per the JSON); returns (engine, sp, per-step losses on this rank)."""
    import deepspeed
    from ds_seqpar import SequenceParallel, comm
    from ds_seqpar.hf import apply_sequence_parallel

    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    ds = load(ds)
    size = int(ds.get("sequence_parallel", {}).get("size", 1))
    ds = resolve(ds, comm.world_size() // size)
    sp = SequenceParallel.from_ds_config(ds)
    torch.manual_seed(0)
    model = apply_sequence_parallel(tiny_model(), sp)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds, mpu=sp.mpu)
    micro = ROWS // sp.dp_size
    losses = []
    for step in range(steps):
        ids, labels = step_rows(step)
        mine = slice(sp.dp_rank * micro, (sp.dp_rank + 1) * micro)           # this replica's rows
        batch = sp.shard_batch({"input_ids": ids[mine], "labels": labels[mine]})
        loss = engine(**{k: v.to(engine.device) for k, v in batch.items()}).loss   # over the whole rows (sp.loss)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, sp, losses


def holder(sp, length: int, position: int) -> int:
    """The rank of sp's group whose share holds ``position`` of a ``length``-token prompt."""
    padded = sp.padded_len(length)
    return next(r for r in range(sp.size) if bool((sp.layout.indices(padded, r) == position).any()))


def prompts(sp, length: int, count: int, seed: int = 1):
    """``count`` prompts of ``length`` tokens (the answer cut off: the query marker is the last token), each
    needle on a rank other than the query's; returns (prompts [count, length], needles [count], needle ranks)."""
    query_rank = holder(sp, length, length - 1)
    spots = [p for p in range(length - 3) if holder(sp, length, p) != query_rank
             and holder(sp, length, p + 1) != query_rank]
    if not spots:
        raise ValueError(f"every position of a {length}-token prompt is on the query's rank under {sp.config}")
    g = torch.Generator().manual_seed(seed)
    rows, needles, ranks = [], [], []
    for i in range(count):
        at = spots[int(torch.randint(0, len(spots), (1,), generator=g))]
        row, n = haystack(g, length + 1, needle_at=at)
        rows.append(row[:-1])
        needles.append(n)
        ranks.append(holder(sp, length, at + 1))
    return torch.stack(rows), torch.tensor(needles), ranks


def greedy(model, ids):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                              do_sample=False, pad_token_id=0)


def check(model, sp, length: int = 64, count: int = 16) -> dict:
    """On every rank: ``model`` (applied with ``sp``; the engine's module) generates greedily for ``count``
    equal-length prompts (one batch) over the sharded cache; against the unsharded model's tokens. Returns
    {accuracy, same, reference_agrees, query_rank, needle_ranks, prompt_tokens, shares}."""
    import deepspeed
    model.eval()
    ids, needles, ranks = prompts(sp, length, count)
    out = greedy(model, ids.to(next(model.parameters()).device)).cpu()
    named = list(model.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in named], enabled=hasattr(named[0][1], "ds_id")):
        state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    refs = []
    for dtype in (torch.float32, torch.float64):      # the same weights, one process, whole attention
        plain = tiny_model(dtype)
        plain.load_state_dict(state)
        refs.append(greedy(plain.eval(), ids))
    model.train()
    return {"accuracy": (out[:, length] == needles).float().mean().item(),
            "same": torch.equal(out, refs[0]), "reference_agrees": torch.equal(refs[0], refs[1]),
            "query_rank": holder(sp, length, length - 1), "needle_ranks": sorted(set(ranks)),
            "prompt_tokens": length, "shares": [len(sp.layout.indices(sp.padded_len(length), r))
                                                for r in range(sp.size)]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed", required=True, help="a DeepSpeed JSON with a sequence_parallel key")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--prompt_tokens", type=int, default=64)
    parser.add_argument("--local_rank", type=int, default=-1)      # the deepspeed launcher passes it
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        torch.set_num_threads(1)       # CPU ranks share the cores: one thread each avoids oversubscription
    start = time.perf_counter()
    engine, sp, losses = train(opts.deepspeed, opts.steps)
    trained = time.perf_counter()
    result = check(engine.module, sp, opts.prompt_tokens)
    checked = time.perf_counter()
    ok = result["accuracy"] == 1.0 and result["same"] and result["reference_agrees"]
    if torch.distributed.get_rank() == 0:
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.4f} in {opts.steps} steps; {sp.config.strategy} P={sp.size}: "
              f"{result}; train {trained - start:.1f} s, generate + references {checked - trained:.1f} s", flush=True)
        print("needles found, tokens equal the unsharded model's" if ok else "FAILED", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
