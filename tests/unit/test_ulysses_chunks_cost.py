"""Ulysses head chunks in the cost model (cost/chunks.py, cost/times.py) and the planner: the price's
limits worked by hand, "auto" staying at one chunk where transfers cannot overlap compute (CPU gloo
ranks), and the plan's choice, column and DeepSpeed JSON. Pure Python, no ranks."""
from __future__ import annotations

import dataclasses

import pytest

from ds_seqpar.cost import chunks as ch, times
from ds_seqpar.cost.candidate import Candidate, Features
from ds_seqpar.plan.ds_json import ds_config
from ds_seqpar.plan.hardware import load_gpu
from ds_seqpar.plan.measure import cpu_profile
from ds_seqpar.cost.model_shape import ModelShape
from ds_seqpar.plan.search import Cluster, predict

# 8 q / 8 kv heads: 4 k/v heads a rank at Ulysses size 2, so 1, 2 or 4 chunks
WIDE = ModelShape("wide", hidden=1024, layers=4, heads=8, kv_heads=8, head_dim=128, intermediate=2816, vocab=1024)


def test_one_chunk_is_the_whole_exchange():
    assert ch.pass_exposed_s(0.3, 0.2, 5.0, 1, 1.0) == 0.5
    # nbytes split: forward q, k, v in and out out; backward dout in and dq, dk, dv out (MHA: a quarter each x ...)
    assert ch.exchange_split(800.0, 0.5) == (300.0, 100.0, 100.0, 300.0)
    gpu = load_gpu("h100")
    c = Candidate("ulysses", 2, 2, 1, Features())
    assert times.ulysses_a2a_s(c, WIDE, gpu, 1e8, 8, 1e-3, 1) == times.all_to_all_time(gpu, 1e8, 2, 8, calls=8)


def test_chunks_hide_all_but_one_chunk_behind_long_compute():
    # no latency, compute far longer than the transfers: each pass exposes one chunk's in and out
    a2a = lambda b, calls: b / 1e9            # noqa: E731
    whole = ch.ulysses_exposed_s(a2a, 8e6, 0.5, 1.0, 2.0, 1, 1.0)
    assert whole == pytest.approx(8e-3)
    for c in (2, 4):
        assert ch.ulysses_exposed_s(a2a, 8e6, 0.5, 1.0, 2.0, c, 1.0) == pytest.approx(8e-3 / c)
    # compute shorter than a chunk's transfers: the excess shows, step by step
    t_in, t_out, comp = 1.0, 1.0, 2.0
    assert ch.pass_exposed_s(t_in, t_out, comp, 2, 1.0) == pytest.approx(2 + (2 - 1))


def test_no_overlap_keeps_one_chunk():
    """comm_overlap 0 (CPU gloo ranks): every chunk's transfer shows and adds its latency, so C = 1."""
    a2a = lambda b, calls: calls * 1e-4 + b / 1e9          # noqa: E731
    prices = {c: ch.ulysses_exposed_s(a2a, 8e6, 0.5, 1.0, 2.0, c, 0.0) for c in (1, 2, 4)}
    assert prices[1] < prices[2] < prices[4]
    assert ch.choose([1, 2, 4], prices.get)[0] == 1
    assert ch.auto_chunks(None, 2, 4096, 8, 8, 128, 2) == 1                 # a CPU device: no rates
    assert ch.chunk_rule("auto", "cpu", "", 2)(4096, 8, 8, 128, 2) == 1
    assert ch.chunk_rule(4, "cpu", "", 2)(4096, 8, 8, 128, 2) == 4          # a configured count is kept
    assert ch.chunk_rule(4, "cpu", "", 2, overlap=False)(4096, 8, 8, 128, 2) == 1


def test_auto_on_a_gpu_profile_chunks_long_sequences_only():
    rates = ch.device_rates("cuda", "NVIDIA H100 80GB HBM3")
    assert rates["overlap"] == 1.0 and rates["alpha_s"] == pytest.approx(load_gpu("h100").intra.alpha_s)
    long_seq = ch.auto_chunks(rates, 2, 65536, 8, 8, 128, 2)
    assert long_seq > 1, long_seq
    assert ch.auto_chunks(rates, 2, 64, 8, 8, 128, 2) == 1                  # latency-bound: one chunk
    assert ch.auto_chunks(rates, 4, 65536, 8, 2, 128, 2) == 1               # one k/v head a rank: nothing to cut


def test_the_plan_chooses_chunks_per_configuration_and_says_why():
    c = Candidate("ulysses", 2, 2, 1, Features())
    gpu = load_gpu("h100")
    # a calibrated CPU profile (ds-seqpar plan --calibrate) says its transfers hide behind nothing
    cpu = cpu_profile({"all_to_all": {"alpha_s": 2e-4, "beta_bytes_s": 2e9}},
                      {"matmul_flops_s": 5e10, "attention_flops_s": 2.5e10})
    assert ch.comm_overlap(cpu) == 0.0 and ch.comm_overlap(gpu) == 1.0
    on_gpu = predict(c, WIDE, 65536, Cluster(2, 8, gpu))
    one = predict(dataclasses.replace(c, ulysses_chunks=1), WIDE, 65536, Cluster(2, 8, gpu))
    assert on_gpu.ulysses_chunks > 1 and on_gpu.chunks_why.startswith(f"{on_gpu.ulysses_chunks}: exposed a2a")
    assert on_gpu.comm_s["attention"] < one.comm_s["attention"] and one.chunks_why == "1: set"
    assert on_gpu.comm_bytes == one.comm_bytes                               # the bytes do not depend on C
    on_cpu = predict(c, WIDE, 65536, Cluster(2, 2, cpu, "fp32"))
    assert (on_cpu.ulysses_chunks, on_cpu.chunks_why) == (1, "1: transfers share the compute's cores")
    ring = predict(Candidate("zigzag", 2, 1, 1, Features()), WIDE, 65536, Cluster(2, 8, gpu))
    assert (ring.ulysses_chunks, ring.chunks_why) == (1, "")                 # no all-to-all
    assert ds_config(c, "bf16", False, on_gpu.ulysses_chunks)["sequence_parallel"]["ulysses_chunks"] == \
        on_gpu.ulysses_chunks
    assert "ulysses_chunks" not in ds_config(c, "bf16", False, 1)["sequence_parallel"]
