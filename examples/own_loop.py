"""Your own model and training loop with ds_seqpar: the README's recipe, runnable as is.

    python examples/own_loop.py                          # 4 local CPU ranks: 2 data x 2 sequence
    deepspeed --num_gpus 4 examples/own_loop.py          # or torchrun --nproc_per_node 4 ...

The model is written the way yours is: its attention layer calls ``attention(q, k, v)``, which is
``sp.attention`` when the model runs sequence-parallel and PyTorch's SDPA when it runs whole. The
printed loss is the mean over every token of the global batch, what one process over the same
rows prints (tests/dist/test_examples.py checks it).
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HEADS, SEQ_LEN, ROWS = 128, 64, 4, 256, 2
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "zero_optimization": {"stage": 2}, "steps_per_print": 10**9,
    "sequence_parallel": {"strategy": "zigzag", "size": 2},
}


def plain_attention(q, k, v):
    """One process, the whole sequence: [batch, seq, heads, dim] in and out, like sp.attention."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=True).transpose(1, 2)


class Block(nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.attention = attention
        self.norm, self.qkv, self.out = nn.LayerNorm(DIM), nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).unflatten(-1, (3, HEADS, DIM // HEADS)).unbind(2)
        # q/k/v are [batch, local_seq, heads, head_dim]: this rank's tokens only
        x = x + self.out(self.attention(q, k, v).flatten(2))
        return x + self.mlp(x)


class TinyLM(nn.Module):
    """Token + learned position embeddings (position_ids are global), two blocks, an LM head."""

    def __init__(self, attention):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ_LEN, DIM)
        self.blocks = nn.ModuleList(Block(attention) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids, position_ids):
        x = self.tok(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def rows(step: int) -> torch.Tensor:
    """The global batch of a step, the same on every rank: ROWS rows of SEQ_LEN random tokens."""
    return torch.randint(0, VOCAB, (ROWS, SEQ_LEN), generator=torch.Generator().manual_seed(step))


def main(steps: int = 3):
    """Train ``steps`` steps; returns this rank's row index and its loss per step."""
    import deepspeed
    from ds_seqpar import SequenceParallel

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    sp = SequenceParallel.from_ds_config(DS_CONFIG)            # reads "sequence_parallel"
    torch.manual_seed(0)
    model = TinyLM(lambda q, k, v: sp.attention(q, k, v, causal=True))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=DS_CONFIG, mpu=sp.mpu)   # ZeRO reduces over data x sequence
    losses = []
    for step in range(steps):
        ids = rows(step)[sp.dp_rank:sp.dp_rank + 1]               # this data-parallel replica's row
        batch = sp.shard_batch({"input_ids": ids, "labels": ids})  # this rank's tokens; labels shifted over
        batch = {key: value.to(engine.device) for key, value in batch.items()}   # the whole row
        logits = engine(batch["input_ids"], batch["position_ids"])
        loss = sp.loss(logits, batch["labels"])                     # mean over the whole sequence
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if torch.distributed.get_rank() == 0:
            print(f"step {step + 1}: loss {losses[-1]:.4f}", flush=True)
    return sp.dp_rank, losses


if __name__ == "__main__":
    from ds_seqpar.launch.spawn import spawn_command, under_launcher
    if under_launcher():
        main()
        torch.distributed.destroy_process_group()   # before exit: a live gloo group can abort shutdown
    else:                   # no launcher: 4 local ranks of this script
        sys.exit(spawn_command([sys.executable, __file__], nprocs=4))
