"""DeepSeek-V3.2-style indexed attention (DeepSeek sparse attention, hf/indexed.py) at N=8192, P=2 against
the unsharded model, fp32, one thread per rank: a one-layer DeepseekV32 model (hidden 256, 4 heads, MLA
latents 64 + 16, indexer 4 heads x 32, top-k 1024), a training step (forward + backward of the loss) on
the whole sequence on one rank (transformers' SDPA path) and under strategy zigzag on two ranks, timed in
alternating rounds after one warm-up round (per round the slower rank; wall seconds and the main thread's
CPU seconds, the latter less exposed to other load on the machine). Also the bytes each rank sent
against closed_form.indexed_attention_bytes. Prints JSON. Run from the repository root:
    PYTHONPATH=$PWD python reports/indexed_attention_cpu.py 3 > reports/indexed_attention_cpu.txt
(a second argument overrides N, for a quick trial)"""
import json
import sys

N = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
SIZES = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
             v_head_dim=32, index_n_heads=4, index_head_dim=32, index_topk=1024, first_k_dense_replace=1,
             vocab_size=256, max_position_embeddings=N, attention_dropout=0.0, use_cache=False)


def work(rounds):
    import time

    import torch
    import transformers as T

    from ds_seqpar import SequenceParallel, comm
    from ds_seqpar.hf import apply_sequence_parallel
    from ds_seqpar.strategies.closed_form import indexed_attention_bytes
    torch.set_num_threads(1)
    cfg = T.DeepseekV32Config(**SIZES)
    torch.manual_seed(0)
    plain = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").train()
    sp = SequenceParallel({"strategy": "zigzag", "size": 2})
    sharded = T.AutoModelForCausalLM.from_config(T.DeepseekV32Config(**SIZES), attn_implementation="sdpa").train()
    sharded.load_state_dict(plain.state_dict())
    apply_sequence_parallel(sharded, sp)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (1, N), generator=g)
    batch = sp.shard_batch({"input_ids": ids, "labels": ids})
    out = {"unsharded": [], "p2": [], "bytes": None}

    def timed(step):
        t0, c0 = time.perf_counter(), time.thread_time()
        step()
        return time.perf_counter() - t0, time.thread_time() - c0

    def unsharded_step():
        plain(input_ids=ids, labels=ids, position_ids=torch.arange(N)[None]).loss.backward()

    def sharded_step():
        sharded(**batch).loss.backward()

    for r in range(rounds + 1):
        comm.barrier(sp.group)
        one = timed(unsharded_step) if sp.rank == 0 else (0.0, 0.0)   # the other rank waits
        comm.barrier(sp.group)
        sp.stats.reset()
        two = timed(sharded_step)
        if r:
            out["unsharded"].append(one)
            out["p2"].append(two)
    sent = {k: sp.stats.bytes[k] for k in ("dsa_latent", "dsa_index_keys")}
    form = indexed_attention_bytes(2, 1, N, cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.index_head_dim, 4)
    out["bytes"] = {"measured": sent, "closed_form": form}
    return out


def main():
    sys.path.insert(0, ".")
    from ds_seqpar.launch.rankpool import RankPool
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    pool = RankPool(2, timeout_s=3600.0).start()
    try:
        res = pool.run(work, rounds)
    finally:
        pool.close()
    def median(xs):
        return sorted(xs)[len(xs) // 2]

    one = [w for w, _ in res[0]["unsharded"]]
    two = [max(a[0], b[0]) for a, b in zip(res[0]["p2"], res[1]["p2"])]
    one_cpu = [c for _, c in res[0]["unsharded"]]
    two_cpu = [max(a[1], b[1]) for a, b in zip(res[0]["p2"], res[1]["p2"])]
    report = {"N": N, "sizes": SIZES, "unsharded_s": one, "p2_s": two,
              "speedup_median": median(one) / median(two),
              # the main thread's CPU seconds: the compute each rank did, less exposed to the machine's load
              "unsharded_cpu_s": one_cpu, "p2_cpu_s": two_cpu, "cpu_speedup_median": median(one_cpu) / median(two_cpu),
              "bytes_rank0": res[0]["bytes"], "bytes_rank1": res[1]["bytes"],
              "bytes_equal_closed_form": all(r["bytes"]["measured"] == r["bytes"]["closed_form"] for r in res)}
    report["loadavg_before"] = load_before
    with open("/proc/loadavg") as f:
        report["loadavg_after"] = f.read().split()[:3]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
