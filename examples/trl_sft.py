"""TRL's SFTTrainer with ds_seqpar sequence parallelism taken from the DeepSpeed JSON.

    deepspeed --num_gpus 4 examples/trl_sft.py --deepspeed configs/trainer/zigzag_zero2.json

``sequence_parallel(SFTTrainer)`` puts ds_seqpar's mixin in front of TRL's trainer: TRL's loss (its
fused LM head scores the pre-shifted ``shift_labels`` of each shard), metrics and collators stay
TRL's. A tiny Llama-architecture model and a word-level tokenizer are built in memory (no hub); the
data is a pre-tokenized prompt/completion set (``completion_only_loss``), right-padded by TRL's
collator; ``padding_free=True`` packs each micro-batch into one row instead (position_ids restarting
at 0 -> documents). fp32 (SFTConfig defaults to bf16): with "size": 1 the same script is plain data
parallelism, and the two agree to fp32 rounding (tests/dist/test_hf_trainer.py).
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_trainer import final_parameters  # noqa: E402  (the sibling example: parameters gathered under ZeRO-3)

VOCAB = 96


def tokenizer():
    """A word-level tokenizer over VOCAB tokens t0..t95 (t0 = pad, t1 = eos), built in memory."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t2"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t2")


def dataset(n: int, seed: int = 0, completion_length=None):
    """Pre-tokenized prompt/completion pairs of varying lengths (TRL skips its own tokenization);
    ``completion_length``: every completion that long (prompts still vary)."""
    from datasets import Dataset
    g = torch.Generator().manual_seed(seed)
    rows = {"input_ids": [], "completion_mask": []}
    for _ in range(n):
        prompt, completion = int(torch.randint(4, 12, (1,), generator=g)), int(torch.randint(10, 30, (1,), generator=g))
        completion = completion_length or completion
        rows["input_ids"].append(torch.randint(3, VOCAB, (prompt + completion,), generator=g).tolist() + [1])
        rows["completion_mask"].append([0] * prompt + [1] * (completion + 1))
    return Dataset.from_dict(rows)


def train(deepspeed, output_dir, max_steps=3, gradient_accumulation_steps=3, per_device_train_batch_size=2,
          samples=48, padding_free=False, packing=False, eval_samples=0, evaluate=None, **overrides):
    """Returns (per-step log, final parameters) on world rank 0 (None elsewhere), with ``eval_samples``
    also ``evaluate(trainer, eval_set)`` (default: ``trainer.evaluate()``'s metrics). ``packing``: TRL's
    best-fit-decreasing packing of the samples into rows of up to 96 tokens (padding-free rows). The eval
    set's completions are all 16 tokens long (as many targets in every row). ``overrides``: other SFTConfig
    fields."""
    import transformers as T
    from trl import SFTConfig, SFTTrainer
    from ds_seqpar.hf import sequence_parallel

    args = SFTConfig(output_dir=output_dir, deepspeed=deepspeed, max_steps=max_steps,
                     per_device_train_batch_size=per_device_train_batch_size,
                     gradient_accumulation_steps=gradient_accumulation_steps, learning_rate=3e-3, warmup_steps=1,
                     max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to="none", seed=0,
                     dataloader_num_workers=0, use_cpu=not torch.cuda.is_available(), completion_only_loss=True,
                     bf16=False, padding_free=padding_free, packing=packing, max_length=96 if packing else None,
                     dataset_num_proc=None, per_device_eval_batch_size=per_device_train_batch_size, **overrides)
    config = T.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
                           attention_dropout=0.0, use_cache=False, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    eval_set = dataset(eval_samples, seed=1, completion_length=16) if eval_samples else None
    trainer = sequence_parallel(SFTTrainer)(model=model, args=args, train_dataset=dataset(samples),
                                            eval_dataset=eval_set, processing_class=tokenizer())
    trainer.train()
    params = final_parameters(trainer)
    metrics = None if eval_set is None else evaluate(trainer, eval_set) if evaluate else trainer.evaluate()
    if not trainer.is_world_process_zero():
        return None
    keys = ("step", "loss", "grad_norm", "learning_rate", "mean_token_accuracy", "entropy", "num_tokens")
    steps = [{k: e[k] for k in keys if k in e} for e in trainer.state.log_history if "loss" in e]
    return (steps, params) if metrics is None else (steps, params, metrics)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed", required=True)
    parser.add_argument("--output_dir", default="runs/trl_sft")
    parser.add_argument("--max_steps", type=int, default=3)
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
