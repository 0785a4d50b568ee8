"""TRL's GRPOTrainer with ds_seqpar sequence parallelism taken from the DeepSpeed JSON.

    deepspeed --num_gpus 4 examples/trl_grpo.py --deepspeed configs/trainer/zigzag_zero2.json
    accelerate launch --config_file acc.yaml examples/trl_grpo.py --deepspeed configs/trainer/zigzag_zero2.json

``sequence_parallel(GRPOTrainer)`` puts ds_seqpar's mixin in front of TRL's trainer: each sequence group is one
data-parallel process of the plain run. Its ranks read the same prompts, sample the same completions (TRL's own
generation, seeded per replica as TRL seeds per process), and score them with the policy's (and reference's)
forward sharded over the group: the per-token log-probs and entropies of TRL's fused LM head come back whole,
so TRL's advantages, clipping, KL, every loss type and every metric are computed as on one plain process
(docs/posttrain.md). A tiny Llama-architecture model and a word-level tokenizer are built in memory (no hub); the
reward is a rule on the completion's words. fp32: with "size": 1 the same script is plain data parallelism, and
the two agree to fp32 rounding (tests/dist/test_trl_grpo.py).
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_trainer import final_parameters  # noqa: E402  (the sibling example: parameters gathered under ZeRO-3)
from trl_dpo import VOCAB, model, tokenizer  # noqa: E402  (the same tiny model and word-level tokenizer)


def prompts(n: int, seed: int = 0, scale: int = 1):
    """Prompts of 4-13 random words (``scale`` times longer)."""
    from datasets import Dataset
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        count = int(torch.randint(4 * scale, 14 * scale, (1,), generator=g))
        rows.append(" ".join(f"t{int(i)}" for i in torch.randint(3, VOCAB, (count,), generator=g)))
    return Dataset.from_dict({"prompt": rows})


def even_words(completions, **_):
    """The reward: the fraction of the completion's words with an even index (a rule the policy can learn)."""
    out = []
    for text in completions:
        words = text.split()
        out.append(sum(int(w[1:]) % 2 == 0 for w in words if w[1:].isdigit()) / max(len(words), 1))
    return out


def saved_model(directory):
    """The tiny model saved by world rank 0 into ``directory`` (a path every rank sees), after a barrier: TRL's
    GRPOTrainer builds its reference model from the policy's path. Call it before a ZeRO-3 config exists (rank 0
    alone would build the model partitioned, in collectives the others never join)."""
    if torch.distributed.get_rank() == 0 and not os.path.exists(directory):
        model().save_pretrained(directory)
        tokenizer().save_pretrained(directory)
    torch.distributed.barrier()
    return directory


def train(deepspeed, output_dir, max_steps=2, gradient_accumulation_steps=2, per_device_train_batch_size=4,
          num_generations=4, max_completion_length=8, samples=32, reference=None, prompt_scale=1, trainer="grpo",
          **overrides):
    """Returns (per-step log, final parameters) on world rank 0 (None elsewhere). ``reference``: a directory every
    rank sees: beta 0.04 with TRL's reference model (the KL term; TRL loads it, and so the policy, from the model
    saved there), else beta 0 (TRL's default: no reference model). ``overrides``: other GRPOConfig fields
    (loss_type, steps_per_generation, num_iterations, temperature, top_k, ...). ``trainer``: "grpo" or "rloo"
    (TRL's RLOOTrainer, the same rollout path with leave-one-out baselines)."""
    import trl
    from ds_seqpar.hf import sequence_parallel
    Config, Trainer = (trl.GRPOConfig, trl.GRPOTrainer) if trainer == "grpo" else (trl.RLOOConfig, trl.RLOOTrainer)

    policy = saved_model(reference) if reference else None   # before the config: ZeRO-3's config would partition it
    args = Config(output_dir=output_dir, deepspeed=deepspeed, max_steps=max_steps,
                      per_device_train_batch_size=per_device_train_batch_size,
                      gradient_accumulation_steps=gradient_accumulation_steps, learning_rate=3e-3, warmup_steps=0,
                      lr_scheduler_type="constant",
                      max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to="none", seed=0,
                      dataloader_num_workers=0, use_cpu=not torch.cuda.is_available(), bf16=False,
                      num_generations=num_generations, max_completion_length=max_completion_length,
                      beta=0.04 if reference else 0.0, gradient_checkpointing=False, log_completions=False,
                      model_init_kwargs={"attn_implementation": "sdpa", "dtype": torch.float32}, **overrides)
    policy = policy or model()
    run = sequence_parallel(Trainer)(model=policy, reward_funcs=even_words, args=args,
                                             train_dataset=prompts(samples, scale=prompt_scale),
                                             processing_class=tokenizer())
    run.train()
    params = final_parameters(run)
    if not run.is_world_process_zero():
        return None
    steps = [{k: v for k, v in e.items() if isinstance(v, (int, float))} for e in run.state.log_history
             if "loss" in e]
    return steps, params


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed", default=None,
                        help="the DeepSpeed JSON (under accelerate launch: the YAML's deepspeed_config_file instead)")
    parser.add_argument("--output_dir", default="runs/trl_grpo")
    parser.add_argument("--max_steps", type=int, default=2)
    parser.add_argument("--local_rank", type=int, default=-1)      # the deepspeed launcher passes it
    opts = parser.parse_args()
    result = train(opts.deepspeed, opts.output_dir, opts.max_steps)
    if result is not None:
        os.makedirs(opts.output_dir, exist_ok=True)
        with open(os.path.join(opts.output_dir, "steps.json"), "w") as f:
            json.dump(result[0], f, indent=1)
        torch.save(result[1], os.path.join(opts.output_dir, "final.pt"))


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():     # a live gloo group can abort interpreter shutdown
        torch.distributed.destroy_process_group()
