"""Memory features in one process: the fused tiled head + loss, the tiled MLP (the project's LM and
Hugging Face Llama), per-layer checkpointing with the host-offload hooks, and the config keys.
Each is compared with the plain computation against a float64 reference (derived tolerances)."""
import os

import pytest
import torch
import torch.nn.functional as F

from ds_seqpar import ConfigError, SequenceParallelConfig
from ds_seqpar.memory import (MemoryConfig, TiledMLP, apply_memory_features, checkpointing, fused_loss_sum,
                              sequence_loss_from_hidden, tile_mlp, tile_mlps, untile_mlp)
from ds_seqpar.models import CausalLM, ModelConfig
from ds_seqpar.models.lm import MLP

from ..reference import assert_derived_close

B, N, H, V = 2, 37, 16, 50


def _head_inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    bias = torch.randn(V, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (B, N), generator=g)
    labels[torch.rand(B, N, generator=g) < 0.3] = -100
    return [t.to(dtype).requires_grad_() for t in (hidden, weight, bias)] + [labels]


def _plain_head_loss(dtype):
    hidden, weight, bias, labels = _head_inputs(dtype)
    loss = F.cross_entropy(F.linear(hidden, weight, bias).view(-1, V), labels.view(-1), reduction="sum")
    loss.backward()
    return [loss.detach(), hidden.grad, weight.grad, bias.grad]


@pytest.mark.parametrize("chunk", [1, 7, 0])
def test_fused_loss_equals_head_plus_cross_entropy(chunk):
    ref64, plain = _plain_head_loss(torch.float64), _plain_head_loss(torch.float32)
    hidden, weight, bias, labels = _head_inputs(torch.float32)
    loss_sum, count = fused_loss_sum(hidden, weight, labels, bias, chunk_tokens=chunk)
    loss_sum.backward()
    assert count.item() == (labels != -100).sum().item()
    for name, got, r, p in zip(("loss_sum", "d_hidden", "d_weight", "d_bias"),
                               (loss_sum.detach(), hidden.grad, weight.grad, bias.grad), ref64, plain):
        assert_derived_close(f"chunk={chunk} {name}", got, r, p)


def test_fused_loss_mean_without_group_and_all_ignored():
    hidden, weight, _, labels = _head_inputs(torch.float32)
    loss = sequence_loss_from_hidden(hidden, torch.nn.Linear(H, V, bias=False), labels, chunk_tokens=5)
    assert loss.dim() == 0 and torch.isfinite(loss)
    labels = torch.full_like(labels, -100)
    loss = sequence_loss_from_hidden(hidden, weight, labels, chunk_tokens=5)
    loss.backward()
    assert loss.item() == 0.0 and not hidden.grad.any() and not weight.grad.any()


def test_fused_loss_refuses_mismatched_shapes():
    hidden, weight, _, labels = _head_inputs(torch.float32)
    with pytest.raises(ValueError, match="must be labels"):
        fused_loss_sum(hidden, weight, labels[:, 1:])
    with pytest.raises(ValueError, match=r"must be \[vocab, hidden=16\]"):
        fused_loss_sum(hidden, weight.t(), labels)


def _mlp_run(make, dtype, chunk, x_grad=True):
    torch.manual_seed(0)
    mlp = make().to(dtype)
    if chunk:
        tile_mlp(mlp, chunk)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, N, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_(x_grad)
    dy = torch.randn(B, N, H, generator=g, dtype=torch.float64).to(dtype)
    y = mlp(x)
    y.backward(dy)
    return mlp, [y.detach(), x.grad] + [p.grad for p in mlp.parameters()]


def _llama_mlp():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP
    return LlamaMLP(LlamaConfig(hidden_size=H, intermediate_size=44, num_attention_heads=2, num_key_value_heads=2))


@pytest.mark.parametrize("make", [lambda: MLP(ModelConfig(dim=H, n_heads=2)), _llama_mlp], ids=["lm", "llama"])
def test_tiled_mlp_is_exact_and_keeps_the_module(make):
    ref64 = _mlp_run(make, torch.float64, 0)[1]
    plain_mlp, plain = _mlp_run(make, torch.float32, 0)
    mlp, got = _mlp_run(make, torch.float32, 5)
    cls = type(plain_mlp)
    assert isinstance(mlp, TiledMLP) and isinstance(mlp, cls), type(mlp).__mro__
    assert list(mlp.state_dict()) == list(plain_mlp.state_dict()), "tiling changed the state_dict keys"
    for i, (g, r, p) in enumerate(zip(got, ref64, plain)):
        assert_derived_close(f"{cls.__name__} output/grad {i}", g, r, p)
    assert type(untile_mlp(mlp)) is cls


def test_tiled_mlp_gives_parameter_gradients_when_its_input_needs_none():
    _, plain = _mlp_run(lambda: MLP(ModelConfig(dim=H, n_heads=2)), torch.float64, 0, x_grad=False)
    _, got = _mlp_run(lambda: MLP(ModelConfig(dim=H, n_heads=2)), torch.float64, 5, x_grad=False)
    assert got[1] is None
    for i, (g, p) in enumerate(zip(got[2:], plain[2:])):
        torch.testing.assert_close(g, p, msg=lambda m: f"parameter {i}: {m}")


class _CountingOffload(checkpointing.offload_saved_tensors):
    packed = 0

    def __init__(self, pin_memory=True):
        super().__init__(pin_memory)
        pack = self.pack_hook

        def counting_pack(t):
            _CountingOffload.packed += 1
            return pack(t)
        self.pack_hook = counting_pack


def _lm_run(dtype, memory: MemoryConfig, monkeypatch=None):
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2)).to(dtype)
    done = apply_memory_features(model, memory)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (B, N), generator=g)
    pos = torch.arange(N).expand(B, N)
    loss = model(ids, pos, labels=torch.roll(ids, -1, 1))
    loss.backward()
    return done, [loss.detach()] + [p.grad for p in model.parameters()]


def test_checkpointing_with_offload_and_tiled_mlp_is_exact_in_the_lm(monkeypatch):
    monkeypatch.setattr(checkpointing, "offload_saved_tensors", _CountingOffload)
    _CountingOffload.packed = 0
    ref64 = _lm_run(torch.float64, MemoryConfig())[1]
    plain = _lm_run(torch.float32, MemoryConfig())[1]
    assert _CountingOffload.packed == 0
    on = MemoryConfig(tiled_mlp_tokens=9, checkpointing=True, cpu_checkpointing=True)
    done, got = _lm_run(torch.float32, on)
    assert done == {"tiled_mlp": ["blocks.0.mlp", "blocks.1.mlp"], "checkpointing": ["CausalLM"],
                    "cpu_checkpointing": ["CausalLM"]}, done
    assert _CountingOffload.packed > 0, "the offload hooks never saw a saved tensor"
    for i, (g, r, p) in enumerate(zip(got, ref64, plain)):
        assert_derived_close(f"LM loss/grad {i}", g, r, p)
    # hooks are left after the forward: nothing outside the model is packed
    count = _CountingOffload.packed
    (torch.ones(3, requires_grad=True) * 2).sum().backward()
    assert _CountingOffload.packed == count


def _hf_run(dtype, memory: MemoryConfig, fused: bool):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(dtype).train()
    done = apply_memory_features(model, memory)
    assert all(layer.gradient_checkpointing == memory.checkpointing for layer in model.model.layers)
    assert done.get("cpu_checkpointing", ["LlamaModel"]) == ["LlamaModel"], done      # the decoder stack
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (B, N), generator=g)
    if fused:
        hidden = model.model(input_ids=ids).last_hidden_state
        labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], dim=1)       # the shift HF applies
        loss = sequence_loss_from_hidden(hidden, model.lm_head, labels, chunk_tokens=10)
    else:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return [loss.detach()] + [p.grad for p in model.parameters()]


def test_hf_llama_checkpointing_tiled_mlp_and_fused_loss_are_exact():
    ref64 = _hf_run(torch.float64, MemoryConfig(), fused=False)
    plain = _hf_run(torch.float32, MemoryConfig(), fused=False)
    got = _hf_run(torch.float32, MemoryConfig(tiled_mlp_tokens=9, checkpointing=True, cpu_checkpointing=True),
                  fused=True)
    for i, (g, r, p) in enumerate(zip(got, ref64, plain)):
        assert_derived_close(f"Llama loss/grad {i}", g, r, p)


def test_memory_config_reads_both_sections():
    ds = {"sequence_parallel": {"strategy": "zigzag", "size": 2, "tiled_loss_tokens": 64, "tiled_mlp_tokens": 32},
          "activation_checkpointing": {"cpu_checkpointing": True}}
    assert MemoryConfig.from_ds_config(ds) == MemoryConfig(64, 32, True, True)
    assert MemoryConfig.from_ds_config({"activation_checkpointing": {}}) == MemoryConfig(checkpointing=True)
    assert MemoryConfig.from_ds_config({}) == MemoryConfig()


@pytest.mark.parametrize("ds,message", [
    ({"activation_checkpointing": {"partition_activations": True}},
     "activation_checkpointing.partition_activations=True is not supported"),
    ({"activation_checkpointing": {"number_checkpoints": 4}},
     "activation_checkpointing.number_checkpoints=4 is not supported"),
    ({"activation_checkpointing": {"cpu_checkpoint": True}},
     "activation_checkpointing.cpu_checkpoint is not a known key"),
    ({"activation_checkpointing": True}, "activation_checkpointing must be an object"),
    ({"sequence_parallel": {"tiled_mlp_tokens": -1}}, "sequence_parallel.tiled_mlp_tokens=-1"),
])
def test_memory_config_refuses_what_it_cannot_honour(ds, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        MemoryConfig.from_ds_config(ds, SequenceParallelConfig.from_ds_config(ds))


def test_tile_mlps_needs_a_module_to_tile():
    with pytest.raises(ValueError, match="has no submodule named 'ffn'"):
        tile_mlps(CausalLM(ModelConfig(vocab_size=V, dim=32, n_layers=1, n_heads=4)), 8, attr="ffn")


# -- StepMemory: each phase's peak above what the process held before the step -------------------

@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="per-phase peaks need Linux /proc")
def test_step_memory_puts_a_transient_in_its_phase_and_not_in_the_next():
    from ds_seqpar.memory.usage import StepMemory
    mem = StepMemory(torch.device("cpu"))
    size = 96 * 2 ** 20                       # above glibc's largest mmap threshold: mapped, then unmapped
    mem.begin()
    mem.mark("big")
    x = torch.ones(size // 4)                 # touched: resident
    del x
    mem.mark("small")
    y = torch.ones(2 ** 16)
    del y
    used = mem.end()
    assert used["peak_phase"] == "big" and used["phases"]["big"] - used["static_bytes"] >= 0.95 * size, used
    assert used["phases"]["small"] - used["static_bytes"] < 0.5 * size, used
    assert used["above_static_bytes"] == used["peak_bytes"] - used["static_bytes"]


def test_transient_bytes_count_the_buffers_a_token_needs_only_at_p_ranks():
    from ds_seqpar.strategies.closed_form import Shapes, transient_bytes
    sh = Shapes(batch=1, seq=1024, heads=8, kv_heads=2, head_dim=16)          # n = 512 per rank at P=2
    kv = 512 * 2 * 32                                                          # local k and v elements
    assert transient_bytes("zigzag", 2, sh) == {"forward": 2 * kv * 4, "backward": 2 * kv * (4 + 4)}
    q = 512 * 8 * 16
    assert transient_bytes("ulysses", 2, sh) == {"forward": (2 * q + kv) * 4, "backward": 2 * (2 * q + kv) * 4}
    # P=4 over 2 k/v heads: each k/v head is sent twice (replication 2); hybrid 2 x 2 = both forms
    sh4 = Shapes(1, 2048, 8, 2, 16)
    assert transient_bytes("ulysses", 4, sh4)["forward"] == (2 * q + 2 * kv) * 4
    hybrid = transient_bytes("ring", 4, sh4, ulysses_size=2)
    assert hybrid["forward"] == (2 * q + kv) * 4 + 2 * kv * 4
    assert transient_bytes("ring", 1, sh) == transient_bytes("lasp", 4, sh) == {"forward": 0, "backward": 0}
    with pytest.raises(ValueError, match="no transient form for strategy 'mystery'"):
        transient_bytes("mystery", 2, sh)
