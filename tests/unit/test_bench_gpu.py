"""``ds-seqpar bench gpu`` on CPU at tiny sizes (the preset without CUDA), through the bench's dispatch: the
rows it writes (kernels, the shares (P=4 here), their bytes, memory), their units, the skipped cases saying why,
compiled shares agreeing with eager; and what of its CUDA branch a CPU build can trace (FakeTensorMode).
"""
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel

from ds_seqpar.bench import gpu
from ds_seqpar.bench.main import main
from ds_seqpar.report.rows import load_rows

VARIANTS = ("plain", "window=64", "softcap=50", "sinks")


def test_tiny_run_writes_every_row(tmp_path):
    assert main(["gpu", "--tiny", "--seqs", "128", "--repeats", "1", "--warmup", "0", "--compile-backend", "aot_eager",
                 "--P", "4", "--out", str(tmp_path)]) == 0           # P=4: dynamo traces half the unrolled loop
    assert (tmp_path / "gpu_cpu.md").exists()
    rows, facts = load_rows(str(tmp_path / "gpu_cpu.rows.json"))
    by = {}
    for r in rows:
        by.setdefault(r.metric, []).append(r)
    assert list(by) == [gpu.KERNELS, gpu.SCHEDULE, gpu.BYTES, gpu.MEMORY, gpu.LASP_HOP, gpu.LASP_BYTES]
    assert set(facts["metrics"]) == set(by)
    hop = {r.case: r for r in by[gpu.LASP_HOP]}
    assert list(hop) == ["lasp1", "allscan"] and all(r.unit == "ms" and r.value > 0 for r in hop.values()), hop
    growth = {r.case: r.value for r in by[gpu.LASP_BYTES]}          # P=4 -> 8: the all-gather's 7/3, the chains' 1
    assert growth == {"lasp2": 7 / 3, "lasp1": 1.0, "allscan": 1.0}, growth

    kernels = {(r.case, r.variant): r for r in by[gpu.KERNELS]}
    ran = [kernels["ds_seqpar torch", f"{v} N=128"] for v in VARIANTS] + [kernels["sdpa flash", "plain N=128"]]
    for r in ran:                                    # CPU: a rate, its spread, no peak to hold it to
        assert r.unit == "TFLOP/s" and r.value > 0 and r.spread[0] <= r.value <= r.spread[1], r
        assert r.detail["of peak"] == "no peak (CPU)" and r.detail["ms"] > 0, r
    for r in [r for r in kernels.values() if r not in ran]:     # the CUDA-only backends, SDPA's missing options, flash-attn
        assert r.value is None and r.detail["not run"], r
    assert {c for c, _ in kernels} == {"sdpa flash", "sdpa cudnn", "sdpa efficient", "ds_seqpar torch", "flash_attn"}

    assert [r.case for r in by[gpu.SCHEDULE]] == list(gpu.STRATEGIES)
    for r in by[gpu.SCHEDULE]:
        assert r.unit == "x" and r.value > 0 and r.variant.endswith("of 4, N=128"), r
        assert 0 <= r.detail["difference"] <= r.detail["allowed"], r        # compiled == eager, to rounding
    for r in by[gpu.BYTES]:
        assert r.unit == "B" and r.value == r.predicted > 0, r              # the copies carry the closed form's bytes
    assert {r.variant for r in by[gpu.SCHEDULE] if r.case == "ring"} == {"rank 3 of 4, N=128"}   # the busiest
    auto = next(r for r in by[gpu.SCHEDULE] if r.case == "ulysses_auto")
    assert auto.detail["chunks"] == 1 and auto.detail["eager / one chunk"] > 0, auto    # "auto" on CPU: one chunk

    memory = {(r.case, r.variant): r.predicted for r in by[gpu.MEMORY]}
    assert all(r.unit == "tokens" and r.value is None for r in by[gpu.MEMORY])   # predicted, never "measured"
    assert memory["features off", "P=1"] < memory["features on+cpu-ckpt", "P=1"] < memory["features on+cpu-ckpt", "P=4"]


def test_cuda_calls_trace_on_fake_tensors():
    """The SDPA call and the all-to-all copies on fake CUDA bf16 (autograd and Python indexing of a fake CUDA
    tensor need a CUDA build: the kernels' CUDA calls are traced in test_compile_cuda_fake.py)."""
    with FakeTensorMode():
        q, k, v = (torch.empty(1, 64, 8, 16, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            with sdpa_kernel(backend):
                out = gpu.sdpa_attend(q, k, v)
            assert (out.shape, out.dtype, out.device.type) == (q.shape, q.dtype, "cuda")
        sent = [0]
        heads = gpu.a2a(q, 4, sent)
        back = gpu.a2a(heads, 4, sent, to_heads=False)
        moved = gpu.hop([k, v], sent)
    assert tuple(heads.shape) == (1, 256, 2, 16) and back.shape == q.shape and back.device.type == "cuda"
    assert [t.shape for t in moved] == [k.shape, v.shape]
    assert sent[0] == 2 * q.numel() * 2 * 3 // 4 + 2 * k.numel() * 2


def test_a2a_round_trip_is_the_identity():
    x = torch.randn(1, 8, 4, 3)
    assert torch.equal(gpu.a2a(gpu.a2a(x, 2, [0]), 2, [0], to_heads=False), x)


def test_a_ring_share_computes_what_its_blocks_say():
    """Ring position 1 of 2 holds its own K/V and (as the copy standing for a transfer) position 0's: its
    share is attention over [k, k] with the first block fully visible and its own causal; the dK/dV that
    travelled home add to its own. Float64 against autograd on the dense masked softmax."""
    from ds_seqpar.kernels import TorchKernel
    from ds_seqpar.strategies import STRATEGIES
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 16, 2, 8, generator=g, dtype=torch.float64) for _ in range(4))
    sent = [0]
    out, dq, dk, dv = gpu.share(TorchKernel(), STRATEGIES["ring"].blocks, 1, 2, 1, q, k, v, dout, sent)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    qb, kb, vb = (t.transpose(1, 2) for t in leaves)                                  # [b, h, s, d]
    scores = qb @ torch.cat([kb, kb], 2).transpose(-1, -2) / 8 ** 0.5
    seen = torch.cat([torch.ones(16, 16, dtype=torch.bool), torch.ones(16, 16, dtype=torch.bool).tril()], 1)
    want = (scores.masked_fill(~seen, float("-inf")).softmax(-1) @ torch.cat([vb, vb], 2)).transpose(1, 2)
    want.backward(dout)
    for got, ref in zip((out, dq, dk, dv), (want, *(t.grad for t in leaves))):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    assert sent[0] == 16 * 2 * 8 * 2 * (8 + 8 + 8)      # one hop each: K/V forward and backward, dK/dV (fp64 here)


def test_a_share_in_head_chunks_is_the_share_in_one():
    """Ulysses' share in 2 head chunks (each rank's heads cut as strategies/ulysses.py cuts them): the same
    outputs and gradients and the same bytes as one chunk."""
    from ds_seqpar.kernels import TorchKernel
    from ds_seqpar.strategies import STRATEGIES
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(1, 8, 8, 4, generator=g, dtype=torch.float64) for _ in range(4))
    sent_one, sent_two = [0], [0]
    one = gpu.share(TorchKernel(), STRATEGIES["ring"].blocks, 2, 1, 0, q, k, v, dout, sent_one)
    two = gpu.share(TorchKernel(), STRATEGIES["ring"].blocks, 2, 1, 0, q, k, v, dout, sent_two, chunks=2)
    for a, b in zip(two, one):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert sent_two == sent_one and sent_one[0] > 0
