"""A/B timing of sp.attention / sp.linear_attention fwd+bwd at P=2, N=8192, fp32, one thread per rank:
the code of the tree TREE, ROUNDS timed rounds after one warm-up. Prints JSON {case: {"wall": [...], "cpu": [...]}}
(per round the max over the two ranks; cpu = the main thread's CPU time). Run two trees alternately, e.g.
    for i in 1 2 3; do python reports/refactor_ab_cpu.py OLD 4; python reports/refactor_ab_cpu.py NEW 4; done"""
import json
import sys
tree, rounds = sys.argv[1], int(sys.argv[2])
sys.path.insert(0, tree)
import torch
from ds_seqpar.launch.rankpool import RankPool

def work(rounds):
    import time, torch
    from ds_seqpar import SequenceParallel
    torch.set_num_threads(1)
    N, H, D = 8192, 8, 64
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, N, H, D, generator=g) for _ in range(4))
    cases = {"ulysses": ({"strategy": "ulysses", "size": 2}, {}),
             "zigzag": ({"strategy": "zigzag", "size": 2}, {}),
             "ring_w1024": ({"strategy": "ring", "size": 2}, {"window": 1024}),
             "lasp": ({"strategy": "lasp", "size": 2}, None)}
    out = {c: [] for c in cases}
    sps = {c: SequenceParallel(cfg) for c, (cfg, _) in cases.items()}
    decay = torch.tensor([1 - 2.0 ** -(5 + h) for h in range(H)])
    for r in range(rounds + 1):
        for c, (cfg, kw) in cases.items():
            sp = sps[c]
            # linear attention without normalisation: q, k scaled so the sums stay in range
            small = 0.1 if kw is None else 1.0
            ql, kl, vl = (sp.shard(t).clone().requires_grad_() for t in (q * small, k * small, v))
            dol = sp.shard(do)
            torch.distributed.barrier(group=sp.group)
            t0, c0 = time.perf_counter(), time.thread_time()
            o = sp.linear_attention(ql, kl, vl, decay=decay) if kw is None else sp.attention(ql, kl, vl, causal=True, **kw)
            o.backward(dol)
            dt, dc = time.perf_counter() - t0, time.thread_time() - c0
            if r:
                out[c].append((dt, dc))
    return out

if __name__ == "__main__":
    p = RankPool(2, timeout_s=600).start()
    import ds_seqpar
    assert ds_seqpar.__file__.startswith(tree), ds_seqpar.__file__      # the tree asked for, not an install
    try:
        res = p.run(work, rounds)
    finally:
        p.close()
    print(json.dumps({c: {"wall": [max(a[0], b[0]) for a, b in zip(res[0][c], res[1][c])],
                          "cpu": [max(a[1], b[1]) for a, b in zip(res[0][c], res[1][c])]} for c in res[0]}))
