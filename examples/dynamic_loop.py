"""An own training loop with dynamic data-sequence groups (docs/dynamic.md).

    python examples/dynamic_loop.py                        # 4 local CPU ranks (gloo)
    torchrun --nproc_per_node 4 examples/dynamic_loop.py   # or deepspeed --num_gpus 4 ...

Every step draws a global batch of documents with real Wikipedia lengths (the same list on every
rank: one seeded generator), the scheduler places each document on a group just large enough
for it (1, 2 or 4 ranks under max_tokens_per_rank), and each rank runs its micro-batches round by
round. The printed loss is the mean over every target token of the step's documents: what plain
data parallelism over the same documents prints.
"""
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
LENGTHS = os.path.join(HERE, "..", "tests", "data", "lengths", "wikipedia_5k.txt")
T, TOKENS_PER_STEP, VOCAB, STEPS = 256, 4096, 256, 3
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "zero_optimization": {"stage": 2}, "steps_per_print": 10**9,
    "sequence_parallel": {"strategy": "zigzag", "size": "dynamic", "max_tokens_per_rank": T},
}


def documents(step, lengths, cap):
    """The step's documents, identical on every rank: lengths from the file (cut at ``cap``, what
    the largest group holds), random token contents, until TOKENS_PER_STEP."""
    rng = np.random.default_rng([0, step])
    docs, total = [], 0
    while total < TOKENS_PER_STEP:
        n = int(min(lengths[rng.integers(lengths.size)], cap, TOKENS_PER_STEP - total))
        docs.append(torch.from_numpy(rng.integers(0, VOCAB, n)))
        total += n
    return docs


def main():
    import deepspeed
    from ds_seqpar.dynamic import DynamicSequenceParallel
    from ds_seqpar.models import CausalLM, ModelConfig
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    model_cfg = ModelConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4)
    dsp = DynamicSequenceParallel.from_ds_config(DS_CONFIG, heads=model_cfg.n_heads)   # every group, built once
    torch.manual_seed(0)
    model = CausalLM(model_cfg, dsp).to(dsp.device)         # its attention calls dsp.attention
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=DS_CONFIG,
                                      mpu=dsp.mpu)
    lengths = np.loadtxt(LENGTHS, dtype=np.int64)
    for step in range(STEPS):
        docs = documents(step, lengths, dsp.capacity)
        schedule = dsp.schedule([d.numel() for d in docs])  # pure: the same on every rank
        mine = schedule.for_rank(dsp.global_rank)           # one micro-batch per round (some empty)
        share = 0.0
        for k, mb in enumerate(mine):
            engine.set_gradient_accumulation_boundary(k == len(mine) - 1)
            with dsp.running(mb):                           # attention goes to mb's group
                batch = {key: v.to(engine.device) for key, v in dsp.batch(mb, [docs[i] for i in mb.documents]).items()}
                logits = engine(batch["input_ids"], batch["position_ids"], cu_seqlens=batch.get("cu_seqlens"))
                loss = dsp.loss(logits, batch["labels"], mb)   # this rank's share of the batch's mean
                engine.backward(loss, scale_wrt_gas=False)
            share += loss.item()
        engine.step()
        step_loss = dsp.step_loss(share)
        if dsp.global_rank == 0:
            print(f"step {step + 1}: loss {step_loss:.4f}, {len(docs)} documents, {len(mine)} rounds, "
                  f"groups {schedule.group_sizes}, priced imbalance {schedule.imbalance:.3f}", flush=True)


if __name__ == "__main__":
    from ds_seqpar.launch.spawn import spawn_command, under_launcher
    if under_launcher():
        main()
        torch.distributed.destroy_process_group()   # before exit: a live gloo group can abort shutdown
    else:                   # no launcher: 4 local ranks of this script
        sys.exit(spawn_command([sys.executable, __file__], nprocs=4))
