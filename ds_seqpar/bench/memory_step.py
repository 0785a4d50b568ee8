"""Rank side of ``ds-seqpar bench memory``: one full training step (forward, backward, optimizer
step) of an LM under DeepSpeed ZeRO-2, with or without the memory features, and the process's
peak resident memory.

Peak memory is the kernel's high-water mark of this process's resident set (VmHWM in
/proc/self/status): every byte the step touched, whoever allocated it (torch, DeepSpeed, gloo,
the allocator's slack). It only grows, so the driver starts fresh processes for every
measurement. A short warm-up step first creates what every step holds (gradient buffers, Adam's
moments), then one step at the measured length: the high-water mark afterwards is that step's
peak, static part included.

Models: "llama", Hugging Face LlamaForCausalLM built from a LlamaConfig (random init, sdpa
attention; at P > 1 its attention goes through ds_seqpar.hf), or "lm", the project's LM.
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict

import torch


@dataclass(frozen=True)
class MemorySpec:
    """One measurement (picklable: it travels to the ranks)."""

    model: str                      # llama | lm
    world: int                      # sequence-parallel size P (dp = 1)
    tokens_per_rank: int
    features: bool                  # tiled loss + tiled MLP + checkpointing (+ host offload)
    vocab: int = 32000
    hidden: int = 256
    layers: int = 8
    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 688         # Llama's ratio: 8/3 x hidden, rounded
    tiled_loss_tokens: int = 256
    tiled_mlp_tokens: int = 1024
    strategy: str = "zigzag"
    warmup_tokens: int = 256        # per rank, for the warm-up step
    steps: int = 1                  # measured steps after the warm-up (timing runs use more)
    seed: int = 0

    @property
    def floor_bytes_per_token(self) -> int:
        """The checkpointed residual stream: one hidden vector per layer per token, fp32."""
        return self.layers * self.hidden * 4

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


def ds_config(spec: MemorySpec) -> dict:
    sp = {"strategy": spec.strategy, "size": spec.world}
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "steps_per_print": 1 << 30,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
          "zero_optimization": {"stage": 2, "overlap_comm": False, "contiguous_gradients": True,
                                "reduce_bucket_size": 50_000_000},
          "sequence_parallel": sp}
    if spec.features:
        sp.update(tiled_loss_tokens=spec.tiled_loss_tokens, tiled_mlp_tokens=spec.tiled_mlp_tokens)
        ds["activation_checkpointing"] = {"cpu_checkpointing": True}
    return ds


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key} line (Linux only)")


def peak_rss_bytes() -> int:
    """VmHWM: the most resident memory this process has had (since the last reset_peak)."""
    return _status_bytes("VmHWM")


def rss_bytes() -> int:
    """VmRSS: resident memory now."""
    return _status_bytes("VmRSS")


def reset_peak() -> None:
    """Start VmHWM again from the current resident set (Linux >= 4.0: clear_refs value 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def build_model(spec: MemorySpec, sp, memory) -> torch.nn.Module:
    """The model with the memory features applied, answering ``(input_ids, position_ids, labels)``
    with the loss (the HF model through the main job's adapter, train/hf_model.py)."""
    from ..memory import apply_memory_features
    torch.manual_seed(spec.seed)
    if spec.model == "lm":
        from ..models import CausalLM, ModelConfig
        cfg = ModelConfig(vocab_size=spec.vocab, dim=spec.hidden, n_layers=spec.layers, n_heads=spec.heads,
                          n_kv_heads=spec.kv_heads, mlp_hidden=spec.intermediate, tie_embeddings=False)
        model = CausalLM(cfg, sp)
        apply_memory_features(model, memory)
        return model
    from transformers import LlamaConfig, LlamaForCausalLM
    from ..train.hf_model import HFCausalLM
    cfg = LlamaConfig(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                      num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                      num_key_value_heads=spec.kv_heads, max_position_embeddings=1 << 20,
                      attn_implementation="sdpa", use_cache=False)
    model = LlamaForCausalLM(cfg).train()
    if spec.world > 1:
        from ..hf import apply_sequence_parallel      # the Hugging Face attention integration
        apply_sequence_parallel(model, sp)
    apply_memory_features(model, memory)
    return HFCausalLM(model, "LlamaConfig (random init)", False, sp)


def loss_of(spec: MemorySpec, engine, sp, local: Dict[str, torch.Tensor]) -> torch.Tensor:
    """sp.loss on the logits, or the fused tiled head + loss with the features (both models)."""
    return engine(local["input_ids"], local["position_ids"], labels=local["labels"])


def _batch(spec: MemorySpec, sp, tokens_per_rank: int, step: int):
    g = torch.Generator().manual_seed(spec.seed * 1000 + step)
    ids = torch.randint(0, spec.vocab, (1, tokens_per_rank * spec.world), generator=g)
    return sp.shard_batch({"input_ids": ids})


def _join_deepspeed() -> None:
    """deepspeed.init_distributed, then drop the name of this rank's /dev/shm all-reduce buffer:
    DeepSpeed's CPU shared-memory all-reduce (deepspeed/ops/csrc/cpu/comm/shm.cpp) creates one
    per rank (~70 MB of RAM) and never unlinks it, so every fresh process would leak one. Once
    every rank is past init (the barrier) each has mapped its peers' buffers; the mappings stay."""
    import deepspeed
    from .. import comm
    deepspeed.init_distributed(dist_backend="gloo")
    comm.barrier()
    env = os.environ
    name = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{env.get('MASTER_ADDR')}_{env.get('MASTER_PORT')}_"
            f"{env.get('RANK')}")
    if os.path.exists(name):
        os.unlink(name)


def measure_peak(spec: MemorySpec) -> Dict[str, Any]:
    """On every rank of a fresh P-rank pool: warm-up step, measured step(s); peak memory and times."""
    import deepspeed
    from ..memory import MemoryConfig
    from ..sequence_parallel import SequenceParallel
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    ds = ds_config(spec)
    memory = MemoryConfig.from_ds_config(ds)
    _join_deepspeed()
    sp = SequenceParallel.from_ds_config(ds)
    model = build_model(spec, sp, memory)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds, mpu=sp.mpu)
    after_setup = peak_rss_bytes()
    _step(spec, engine, sp, _batch(spec, sp, spec.warmup_tokens, 0))       # buffers, Adam's moments
    records = [_step(spec, engine, sp, _batch(spec, sp, spec.tokens_per_rank, 1 + i)) for i in range(spec.steps)]
    last = records[-1]
    return dict(last, after_setup_bytes=after_setup, rank=sp.rank,
                step_s=[r["step_s"] for r in records], losses=[r["loss"] for r in records])


PHASES = ("forward", "loss_backward", "layers_backward", "end_of_backward", "optimizer")


class PhasePeaks:
    """The high-water mark of each phase of a step alone: ``mark(name)`` closes the phase running
    (its VmHWM since the last reset is its peak) and resets the mark for the next one. The
    boundaries come from hooks: the last decoder layer's output gradient starts the layers'
    backward, the embedding output's gradient its end (DeepSpeed's last reductions)."""

    def __init__(self, model: torch.nn.Module, spec: MemorySpec):
        self.peaks: Dict[str, int] = {}
        self.current = None
        inner = model.model.model if spec.model == "llama" else model       # HFCausalLM -> Llama -> decoder
        layers = inner.layers if spec.model == "llama" else inner.blocks
        embed = inner.embed_tokens if spec.model == "llama" else inner.embed
        self.handles = [self._on_output_grad(layers[-1], "layers_backward"),
                        self._on_output_grad(embed, "end_of_backward")]

    def _on_output_grad(self, module, phase):
        def hook(mod, args, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            if torch.is_grad_enabled() and out.requires_grad:
                out.register_hook(lambda grad: self.mark(phase))
        return module.register_forward_hook(hook)

    def mark(self, phase) -> None:
        if self.current is not None:
            self.peaks[self.current] = max(self.peaks.get(self.current, 0), peak_rss_bytes())
        reset_peak()
        self.current = phase


def _step(spec: MemorySpec, engine, sp, local) -> Dict[str, Any]:
    """One step: resident memory before it, the peak of each phase and of the whole step."""
    phases = PhasePeaks(engine.module, spec)
    reset_peak()
    resident = rss_bytes()                  # weights, gradient buffers, optimizer state, runtime
    t0 = time.perf_counter()
    phases.mark("forward")
    loss = loss_of(spec, engine, sp, local)
    phases.mark("loss_backward")
    engine.backward(loss)
    phases.mark("optimizer")
    engine.step()
    phases.mark(None)
    step_s = time.perf_counter() - t0
    for h in phases.handles:
        h.remove()
    return {"resident_bytes": resident, "phase_peak_bytes": phases.peaks, "peak_bytes": max(phases.peaks.values()),
            "step_s": step_s, "loss": loss.item()}


def time_steps(off: MemorySpec, on: MemorySpec, rounds: int) -> Dict[str, Any]:
    """Step seconds without and with the features, in alternating rounds inside one process (load
    from other processes then hits both alike); each round runs ``steps`` steps of each."""
    import deepspeed
    from ..memory import MemoryConfig
    from ..sequence_parallel import SequenceParallel
    torch.set_num_threads(1)
    _join_deepspeed()
    runs = []
    for spec in (off, on):
        ds = ds_config(spec)
        sp = SequenceParallel.from_ds_config(ds)
        model = build_model(spec, sp, MemoryConfig.from_ds_config(ds))
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds, mpu=sp.mpu)
        _timed_step(spec, engine, sp, 0)                    # warm-up: buffers, Adam's moments
        runs.append((spec, engine, sp))
    times = {"off_s": [], "on_s": []}
    for rnd in range(rounds):
        for name, (spec, engine, sp) in zip(("off_s", "on_s"), runs):
            steps = [_timed_step(spec, engine, sp, 1 + rnd * spec.steps + i) for i in range(spec.steps)]
            times[name].append(sorted(steps)[len(steps) // 2])
    return times


def _timed_step(spec, engine, sp, step: int) -> float:
    local = _batch(spec, sp, spec.tokens_per_rank, step)
    t0 = time.perf_counter()
    engine.backward(loss_of(spec, engine, sp, local))
    engine.step()
    return time.perf_counter() - t0


__all__ = ["MemorySpec", "ds_config", "measure_peak", "time_steps", "peak_rss_bytes", "build_model", "PHASES"]
