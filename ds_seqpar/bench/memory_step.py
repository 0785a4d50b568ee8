"""Rank side of ``ds-seqpar bench memory``: the main job itself (``run_training``, the code a user's
``python -m ds_seqpar.train`` runs: its data, model, DeepSpeed engine and training step), with or
without the memory features, and each phase's peak of its last step (the trainer's StepMemory).

Peak memory is the kernel's high-water mark of this process's resident set (VmHWM in
/proc/self/status, reset per phase): every byte the step touched, whoever allocated it (torch,
DeepSpeed, gloo, the allocator's slack). Static is the resident set just before the step. The
main job's first step creates what every later step holds (gradient buffers, Adam's moments), so
the measured step is the last of ``steps + 1``: its peak minus static is what the step itself costs.

Models: "llama", Hugging Face LlamaForCausalLM from a LlamaConfig written to a config JSON and
given to the main job as ``--model`` (random init, sdpa attention, ds_seqpar.hf at P > 1), or
"lm", the project's LM with the same sizes.
"""
from __future__ import annotations

import json
import os
import tempfile
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
    ulysses_size: int = 1           # > 1: the 2D hybrid
    purpose: str = "scaling"        # scaling: the per-token fits; strategies: the per-strategy comparison
    steps: int = 1                  # measured steps after the first (timing runs: steps per round)
    seed: int = 0

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


def ds_config(spec: MemorySpec) -> dict:
    sp = {"strategy": spec.strategy, "size": spec.world}
    if spec.ulysses_size > 1:
        sp["ulysses_size"] = spec.ulysses_size
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
    """deepspeed.init_distributed, then drop the name of this rank's /dev/shm all-reduce buffer
    (launch/env.py release_deepspeed_shm): every fresh process would leak one otherwise."""
    import deepspeed
    from .. import comm
    from ..launch.env import release_deepspeed_shm
    deepspeed.init_distributed(dist_backend="gloo")
    comm.barrier()
    release_deepspeed_shm(os.environ)


def train_options(spec: MemorySpec, workdir: str) -> Dict[str, Any]:
    """The main job's options (``python -m ds_seqpar.train``'s, as a dict) for this measurement."""
    opts = dict(deepspeed_config=ds_config(spec), sp_size=spec.world, seq_len=spec.tokens_per_rank * spec.world,
                steps=spec.steps + 1, seed=spec.seed, run_dir=os.path.join(workdir, "runs"), run_name="memory",
                no_wandb=True, quiet=True)
    if spec.ulysses_size > 1:
        opts["ulysses_size"] = spec.ulysses_size
    if spec.model == "lm":
        return dict(opts, dim=spec.hidden, n_layers=spec.layers, n_heads=spec.heads, n_kv_heads=spec.kv_heads,
                    mlp_hidden=spec.intermediate, untied=True, vocab_size=spec.vocab)
    path = os.path.join(workdir, "llama.json")
    with open(path, "w") as f:
        json.dump(llama_config(spec), f)
    return dict(opts, model=path)


def llama_config(spec: MemorySpec) -> Dict[str, Any]:
    return {"model_type": "llama", "vocab_size": spec.vocab, "hidden_size": spec.hidden,
            "intermediate_size": spec.intermediate, "num_hidden_layers": spec.layers,
            "num_attention_heads": spec.heads, "num_key_value_heads": spec.kv_heads,
            "max_position_embeddings": 1 << 20, "tie_word_embeddings": False, "use_cache": False,
            "attn_implementation": "sdpa"}


def measure_peak(spec: MemorySpec) -> Dict[str, Any]:
    """On every rank of a fresh P-rank pool: the main job for ``steps + 1`` steps; the last step's
    static, peak and phase peaks (the trainer's StepMemory records)."""
    from ..train import run_training
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    _join_deepspeed()
    with tempfile.TemporaryDirectory() as tmp:
        out = run_training(train_options(spec, tmp))
    if not out["memory"] or out["memory"][-1]["static_bytes"] is None:
        raise RuntimeError("ds-seqpar bench memory needs per-phase peaks (Linux /proc/self/clear_refs or CUDA)")
    records = out["memory"][1:]                     # the first step creates the buffers every step holds
    last = records[-1]
    return {"resident_bytes": last["static_bytes"], "phase_peak_bytes": last["phases"],
            "peak_bytes": last["peak_bytes"], "peak_phase": last["peak_phase"], "rank": out["rank"],
            "step_s": [r["step_s"] for r in records], "losses": out["losses"][1:]}


PHASES = ("data", "forward", "loss_backward", "layers_backward", "end_of_backward", "optimizer")


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


__all__ = ["MemorySpec", "ds_config", "train_options", "measure_peak", "time_steps", "build_model", "PHASES"]
