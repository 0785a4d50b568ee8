"""TRL's DPOTrainer with ds_seqpar sequence parallelism taken from the DeepSpeed JSON.

    deepspeed --num_gpus 4 examples/trl_dpo.py --deepspeed configs/trainer/zigzag_zero2.json
    accelerate launch --config_file acc.yaml examples/trl_dpo.py --deepspeed configs/trainer/zigzag_zero2.json

``sequence_parallel(DPOTrainer)`` puts ds_seqpar's mixin in front of TRL's trainer: TRL's collator, losses
(every ``loss_type``) and metrics stay TRL's and see whole rows; inside the policy's and the reference's
forward the rows are sharded, and the per-token log-probs and entropies of TRL's fused LM head come back whole
(docs/posttrain.md). A tiny Llama-architecture model and a word-level tokenizer are built in memory (no hub);
the data is random prompt / chosen / rejected text over that vocabulary. fp32: with "size": 1 the same script
is plain data parallelism, and the two agree to fp32 rounding (tests/dist/test_trl_dpo.py).
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
    """Words t0..t95 (t0 = pad, t1 = eos) split on spaces, built in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t2")


def dataset(n: int, seed: int = 0, scale: int = 1):
    """Preference pairs of varying lengths (prompts 4-11 words, completions 6-20, ``scale`` times longer);
    every completion ends with the eos word (TRL would append it)."""
    from datasets import Dataset
    g = torch.Generator().manual_seed(seed)

    def words(lo, hi):
        count = int(torch.randint(lo * scale, hi * scale, (1,), generator=g))
        return " ".join(f"t{int(i)}" for i in torch.randint(3, VOCAB, (count,), generator=g))

    rows = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(n):
        rows["prompt"].append(words(4, 12))
        rows["chosen"].append(" " + words(6, 21) + " t1")
        rows["rejected"].append(" " + words(6, 21) + " t1")
    return Dataset.from_dict(rows)


def on_disk(data, directory):
    """``data`` saved by world rank 0 into ``directory`` and read back by every rank (after a barrier)."""
    from datasets import load_from_disk
    if torch.distributed.get_rank() == 0 and not os.path.exists(directory):
        data.save_to_disk(directory)
    torch.distributed.barrier()
    return load_from_disk(directory)


def model(hidden=64, layers=2):
    import transformers as T
    config = T.LlamaConfig(hidden_size=hidden, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=8192,
                           attention_dropout=0.0, use_cache=False, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def train(deepspeed, output_dir, max_steps=3, gradient_accumulation_steps=3, per_device_train_batch_size=2,
          samples=36, eval_samples=0, reference="model", data_dir=None, **overrides):
    """Returns (per-step log, final parameters[, evaluate() metrics]) on world rank 0 (None elsewhere).
    ``reference``: "model" (a separate reference model, the policy's initial weights) or "precompute"
    (precompute_ref_log_probs=True: TRL scores the data set with the initial policy before training; TRL then
    caches the scores beside the data set, so ``data_dir``, a directory every rank sees, holds the data set).
    ``overrides``: other DPOConfig fields (loss_type, beta, ...)."""
    from trl import DPOConfig, DPOTrainer
    from ds_seqpar.hf import sequence_parallel

    args = DPOConfig(output_dir=output_dir, deepspeed=deepspeed, max_steps=max_steps,
                     per_device_train_batch_size=per_device_train_batch_size,
                     gradient_accumulation_steps=gradient_accumulation_steps, learning_rate=3e-3, warmup_steps=1,
                     max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to="none", seed=0,
                     dataloader_num_workers=0, use_cpu=not torch.cuda.is_available(), bf16=False,
                     dataset_num_proc=None, per_device_eval_batch_size=per_device_train_batch_size,
                     precompute_ref_log_probs=reference == "precompute", gradient_checkpointing=False, **overrides)
    policy = model()
    ref = model() if reference == "model" else None
    eval_set = dataset(eval_samples, seed=1) if eval_samples else None
    train_set = dataset(samples) if data_dir is None else on_disk(dataset(samples), data_dir)
    trainer = sequence_parallel(DPOTrainer)(model=policy, ref_model=ref, args=args, train_dataset=train_set,
                                            eval_dataset=eval_set, processing_class=tokenizer())
    trainer.train()
    params = final_parameters(trainer)
    metrics = trainer.evaluate() if eval_set is not None else None
    if not trainer.is_world_process_zero():
        return None
    steps = [{k: v for k, v in e.items() if isinstance(v, (int, float))} for e in trainer.state.log_history
             if "loss" in e]
    return (steps, params) if metrics is None else (steps, params, metrics)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed", default=None,
                        help="the DeepSpeed JSON (under accelerate launch: the YAML's deepspeed_config_file instead)")
    parser.add_argument("--output_dir", default="runs/trl_dpo")
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
