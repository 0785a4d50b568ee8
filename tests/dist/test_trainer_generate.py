"""sequence_parallel(Seq2SeqTrainer) with predict_with_generate=True on a causal LM, on the 4-rank pool: predict()
and evaluate() generate through the applied model's sharded-cache generate, gathered over the replicas. The
generated tokens equal (exactly) the unsharded model's generate on the same prompts (one process, float32 and
float64, which must agree) and plain Seq2SeqTrainer's predictions (size 1, 4 replicas, the same weights:
learning rate 0). eval_loss (the sharded loss step beside generation) equals the unsharded float64 model's mean
token loss over the prompts to fp32 rounding (1e-5 relative, as tests/dist/test_hf_trainer.py): equal-length rows,
so the Trainer's mean of per-step means over the replicas, truncated to the 10 rows, is that mean. (Plain's own
eval_loss is not the reference: it averages its untruncated pad rows in, see below.)
Prompts of equal length (a padded batch is refused by generate); 10 of them, so the last eval step pads with
the first rows and the replicas' gather truncates. (Plain's predict() with 4 processes of 1 returns those 2 pad
rows too, with or without generation: accelerate did not truncate its last step there; its first 10 rows are
compared.)"""
import tempfile

import pytest
import torch

from .test_hf_trainer import _example, ds_config, reset_worker_state

PROMPTS, LENGTH, NEW = 10, 12, 4


def eval_rows():
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(3, 96, (LENGTH,), generator=g) for _ in range(PROMPTS)]
    return [{"input_ids": r, "labels": r.clone()} for r in rows]


def run_seq2seq(cfg, micro):
    """On every rank: 1 training step at learning rate 0 (DeepSpeed is set up by train()), then predict() and
    evaluate() with generation; every rank returns (predictions, label_ids, metrics, final parameters)."""
    import transformers as T
    from ds_seqpar.hf import sequence_parallel
    example = _example()
    with tempfile.TemporaryDirectory() as out:
        try:
            args = T.Seq2SeqTrainingArguments(**_arguments(example, cfg, out, micro))
            torch.manual_seed(0)
            model = example.tiny_model()
            model.config.pad_token_id = model.generation_config.pad_token_id = 0
            trainer = sequence_parallel(T.Seq2SeqTrainer)(
                model=model, args=args, train_dataset=example.synthetic_sft(16, 96), eval_dataset=eval_rows(),
                data_collator=example.pad_right)
            trainer.train()
            pred = trainer.predict(eval_rows(), max_new_tokens=NEW)
            metrics = trainer.evaluate(max_new_tokens=NEW)
            return pred.predictions, pred.label_ids, metrics, example.final_parameters(trainer)
        finally:
            reset_worker_state()


def _arguments(example, cfg, out, micro):
    options = {k: v for k, v in vars(example.arguments(cfg, out, 1, 1, micro)).items()
               if k in ("output_dir", "deepspeed", "max_steps", "per_device_train_batch_size", "gradient_accumulation_steps",
                        "per_device_eval_batch_size", "logging_steps", "save_strategy", "report_to", "seed",
                        "use_cpu", "disable_tqdm", "dataloader_num_workers")}
    return dict(options, learning_rate=0.0, predict_with_generate=True)


def unsharded_loss(params):
    """The same weights in float64 on one process: the mean token loss over every prompt (labels = the prompt)."""
    model = _example().tiny_model().to(torch.float64)
    model.load_state_dict(params)
    prompts = torch.stack([r["input_ids"] for r in eval_rows()])
    with torch.no_grad():
        return model.eval()(input_ids=prompts, labels=prompts).loss.item()


def unsharded_generate(params):
    """The same weights on one process: greedy generate of every prompt, float32 and float64."""
    example = _example()
    prompts = torch.stack([r["input_ids"] for r in eval_rows()])
    outs = []
    for dtype in (torch.float32, torch.float64):
        model = example.tiny_model().to(dtype)
        model.load_state_dict(params)
        with torch.no_grad():
            outs.append(model.eval().generate(input_ids=prompts, max_new_tokens=NEW, do_sample=False, pad_token_id=0))
    assert torch.equal(outs[0], outs[1]), "float32 and float64 greedy differ (test model)"
    return outs[0]


_PLAIN = {}


@pytest.mark.parametrize("sp", [dict(strategy="zigzag", size=2), dict(strategy="ulysses", size=4)],
                         ids=["zigzag2", "ulysses4"])
def test_seq2seq_predict_with_generate_equals_unsharded_generate(pool, sp):
    if "plain" not in _PLAIN:
        _PLAIN["plain"] = pool.run(run_seq2seq, ds_config(2, strategy="zigzag", size=1), 1)[0]
    want_pred, want_labels, want_metrics, params = _PLAIN["plain"]
    assert (want_pred[PROMPTS:] == want_pred[:len(want_pred) - PROMPTS]).all()       # plain's untruncated pad rows
    want_pred, want_labels = want_pred[:PROMPTS], want_labels[:PROMPTS]
    reference = unsharded_generate(params).numpy()
    assert (want_pred[:, :LENGTH + NEW] == reference).all(), "plain Seq2SeqTrainer vs model.generate (test setup)"
    assert (want_pred[:, LENGTH + NEW:] == 0).all(), "Seq2SeqTrainer pads to generation max_length with pad id 0"
    for rank, (pred, labels, metrics, got_params) in enumerate(pool.run(run_seq2seq, ds_config(2, **sp), sp["size"])):
        what = f"{sp} rank {rank}"
        assert all(torch.equal(got_params[n], params[n]) for n in params), f"{what}: weights differ (lr 0)"
        assert pred.shape == want_pred.shape and pred.shape[0] == PROMPTS, (what, pred.shape, want_pred.shape)
        assert (pred[:, :LENGTH + NEW] == reference).all(), f"{what}: {pred} != {reference}"
        assert (pred == want_pred).all() and (labels == want_labels).all(), what
        if sp["size"] == 4:
            # 1 replica: its loader was sharded for the 4 world ranks and still pads the last step with rows 0, 1
            # (2 real rows of 4); the tokens are truncated after the gather, but the Trainer's eval loss counts the
            # padded step's mean (the mixin's eval loss, with or without generation; not this feature's)
            continue
        loss, ref = metrics["eval_loss"], unsharded_loss(params)
        assert abs(loss - ref) <= 1e-5 * abs(ref), (what, loss, ref)
