"""transformers' Trainer with ds_seqpar sequence parallelism taken from the DeepSpeed JSON.

    deepspeed --num_gpus 4 examples/hf_trainer.py --deepspeed configs/trainer/zigzag_zero2.json

A tiny Llama-architecture model from a config (no hub), an embedded synthetic SFT set (variable
lengths, prompt tokens masked with -100, right padding by the collator), 2 data x 2 sequence ranks
with the config above. With "size": 1 (or no sequence_parallel key) the same script is plain data
parallelism: run it on 2 ranks and the logged loss, grad_norm and learning_rate per step and the
final parameters are the same (tests/e2e/test_examples_launch.py).
"""
import argparse
import json
import os

import torch


def synthetic_sft(n: int, vocab: int, seed: int = 0):  # noqa: D401
    """n samples of 20-44 tokens; the first 4-11 tokens are the prompt (no loss on them)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(20, 45, (1,), generator=g))
        ids = torch.randint(3, vocab, (length,), generator=g)
        labels = ids.clone()
        labels[:int(torch.randint(4, 12, (1,), generator=g))] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def pad_right(rows, extra: int = 0):
    """Right padding (pad id 0, label -100) and an attention_mask, as HF's SFT collators do, to the
    longest row (plus ``extra`` columns)."""
    width = max(len(r["input_ids"]) for r in rows) + extra
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = r["input_ids"], r["labels"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def tiny_model():
    """A 2-layer Llama-architecture model (GQA: 4 query, 2 key/value heads), vocabulary 96."""
    import transformers as T
    config = T.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=96, max_position_embeddings=256,
                           attention_dropout=0.0, use_cache=False)
    return T.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def flattening(**options):
    """transformers' packing collator: each micro-batch one row of its samples, position_ids restarting
    at every sample, the first label of each -100, no attention_mask."""
    from transformers import DataCollatorWithFlattening
    return DataCollatorWithFlattening(**options)


COLLATORS = {"pad_right": lambda: pad_right, "flattening": flattening,
             "flattening_cu_seqlens": lambda: flattening(return_flash_attn_kwargs=True)}


def train(deepspeed, output_dir, max_steps=4, gradient_accumulation_steps=3, per_device_train_batch_size=2,
          samples=64, eval_samples=0, gradient_checkpointing=False, lora=False, save_steps=0,
          resume_from_checkpoint=None, collator="pad_right", pretrained=None, **overrides):
    """Train; returns (per-step log [{step, loss, grad_norm, learning_rate}], final parameters) on world
    rank 0 (None elsewhere); with ``eval_samples``, also (eval metrics, predict() logits, label ids)
    after training. ``deepspeed``: a path or a dict; ``lora``: LoRA adapters (peft) on q/v projections;
    ``save_steps``: a checkpoint every that many steps in output_dir; ``resume_from_checkpoint``: as
    ``Trainer.train`` takes it; ``collator``: one of COLLATORS; ``pretrained``: a directory to load the
    model from (else the tiny model below, seed 0); ``overrides``: other TrainingArguments fields."""
    import transformers as T
    from ds_seqpar.hf import SequenceParallelTrainer

    args = arguments(deepspeed, output_dir, max_steps, gradient_accumulation_steps, per_device_train_batch_size,
                     gradient_checkpointing=gradient_checkpointing, save_strategy="steps" if save_steps else "no",
                     save_steps=save_steps or 500, **overrides)
    if pretrained:      # under ZeRO-3, transformers loads it into partitioned parameters (zero.Init)
        model = T.AutoModelForCausalLM.from_pretrained(pretrained, attn_implementation="sdpa")
    else:
        torch.manual_seed(0)
        model = tiny_model()
    if lora:
        from peft import LoraConfig, get_peft_model
        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 lora_dropout=0.0, init_lora_weights="gaussian"))
    eval_set = synthetic_sft(eval_samples, 96, seed=1) if eval_samples else None
    trainer = SequenceParallelTrainer(model=model, args=args, train_dataset=synthetic_sft(samples, 96),
                                      eval_dataset=eval_set, data_collator=COLLATORS[collator]())
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    params = final_parameters(trainer)
    evaluated = None
    if eval_set is not None:
        metrics = trainer.evaluate()
        pred = trainer.predict(eval_set)
        evaluated = (metrics["eval_loss"], pred.predictions, pred.label_ids)
    if not trainer.is_world_process_zero():
        return None
    steps = logged_steps(trainer)
    return (steps, params) if evaluated is None else (steps, params, evaluated)


def arguments(deepspeed, output_dir, max_steps, gradient_accumulation_steps, per_device_train_batch_size,
              **overrides):
    """The run's TrainingArguments: one log record per step, no checkpoints, no reporting, seed 0, fp32;
    ``overrides`` replace or add any TrainingArguments field (ds_seqpar/bench/trainer.py uses them)."""
    import transformers as T
    options = dict(output_dir=output_dir, deepspeed=deepspeed, max_steps=max_steps,
                   per_device_train_batch_size=per_device_train_batch_size,
                   gradient_accumulation_steps=gradient_accumulation_steps, learning_rate=3e-3, warmup_steps=1,
                   max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to="none", seed=0,
                   per_device_eval_batch_size=per_device_train_batch_size, dataloader_num_workers=0,
                   use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    return T.TrainingArguments(**dict(options, **overrides))


def logged_steps(trainer):
    """The Trainer's per-step log records: step, loss, grad_norm, learning_rate."""
    return [{k: e[k] for k in ("step", "loss", "grad_norm", "learning_rate")} for e in trainer.state.log_history
            if "loss" in e]


def final_parameters(trainer):
    """Full parameters (ZeRO-3 partitions gathered), on every rank."""
    import deepspeed as ds
    model = trainer.model_wrapped.module if hasattr(trainer.model_wrapped, "module") else trainer.model
    named = list(model.named_parameters())
    with ds.zero.GatheredParameters([p for _, p in named], enabled=hasattr(named[0][1], "ds_id")):
        return {n: p.detach().cpu().clone() for n, p in named}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed", default=None, help="the DeepSpeed JSON (default: the deepspeed_config_file "
                        "of `accelerate launch --config_file`)")
    parser.add_argument("--output_dir", default="runs/hf_trainer")
    parser.add_argument("--max_steps", type=int, default=4)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=3)
    parser.add_argument("--per_device_train_batch_size", type=int, default=2)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--local_rank", type=int, default=-1)      # the deepspeed launcher passes it
    opts = parser.parse_args()
    result = train(opts.deepspeed, opts.output_dir, opts.max_steps, opts.gradient_accumulation_steps,
                   opts.per_device_train_batch_size, opts.samples)
    if result is not None:
        steps, params = result
        os.makedirs(opts.output_dir, exist_ok=True)
        with open(os.path.join(opts.output_dir, "steps.json"), "w") as f:
            json.dump(steps, f, indent=1)
        torch.save(params, os.path.join(opts.output_dir, "final.pt"))
    if torch.distributed.is_initialized():
        # every rank done before any leaves, then an orderly teardown of the process group rather than
        # one left to the interpreter's exit (PyTorch's advice for the end of a distributed script)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():     # a live gloo group can abort interpreter shutdown
        torch.distributed.destroy_process_group()
