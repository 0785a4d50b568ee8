"""The main job with a Hugging Face model (--model): sequence x data parallel training with ZeRO
equals plain data-parallel training of the same model; the README command runs; bad combinations
stop every rank with one message."""
import os

import pytest

from ..zoo.hybrids import hybrid_config
from ..hf_models import save_tiny
from ..zoo.vlm import CONFIGS as VLM_CONFIGS
from ..train_reference import reference_losses
from .test_train_e2e import (CONFIGS, NORM_REL, TINY, _train, assert_close_losses, assert_refused_before_training,
                             config_error_of, shipped_config)

ROOT = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)
HF_TINY = {k: v for k, v in TINY.items() if k not in ("dim", "n_layers", "n_heads", "n_kv_heads")}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_models")
    hybrid = root / "qwen3_5"            # gated DeltaNet + conv layer next to a softmax layer (docs/hybrids.md)
    hybrid_config("qwen3_5_text", vocab_size=300).save_pretrained(hybrid)
    vlm = root / "qwen2_5_vl"            # tests/zoo/vlm.py's tiny Qwen2.5-VL, its image token above the byte corpus
    vlm_config = VLM_CONFIGS["qwen2_5_vl"]()
    vlm_config.text_config.vocab_size, vlm_config.image_token_id = 300, 260
    vlm_config.save_pretrained(vlm)
    return {"weights": save_tiny(root / "llama", "llama", seed=5, vocab_size=256),
            "config": save_tiny(root / "qwen2", "qwen2", weights=False, vocab_size=300), "hybrid": str(hybrid),
            "vlm": str(vlm)}


@pytest.mark.parametrize("kind,stage,name", [("weights", 2, "zigzag"), ("config", 1, "ulysses"),
                                             ("weights", 2, "hybrid"), ("weights", 3, "striped"),
                                             ("hybrid", 2, "zigzag"), ("hybrid", 3, "ring")])
def test_hf_model_training_matches_plain_data_parallel(pool, tmp_path, model_dirs, kind, stage, name):
    """dp 2 x sp 2 zigzag with from_pretrained weights under ZeRO-2; a random init (from_config) under
    ZeRO-1 with Ulysses; the 2D hybrid (ring of 2 Ulysses pairs, sp 4); ZeRO-3 with the plain recipe; a
    Qwen3.5-style hybrid (gated DeltaNet, LASP state maps, conv halo) under zigzag at ZeRO-2 and ring at ZeRO-3,
    with every decoder layer checkpointed (the recomputed forward exchanges its state maps and halos again)."""
    ds = shipped_config(name)
    ds["zero_optimization"]["stage"] = stage
    if kind == "hybrid":
        ds["activation_checkpointing"] = {}          # present: checkpoint every decoder layer
    args = dict(HF_TINY, model=model_dirs[kind], deepspeed_config=ds)
    results = pool.run(_train, dict(args, run_dir=str(tmp_path)))
    sp_size = ds["sequence_parallel"]["size"]
    ref, ref_norms = reference_losses(args, len(results) // sp_size)
    for r in results:
        what = f"--model {kind} {name} ZeRO-{stage} rank {r['rank']} (dp_rank {r['dp_rank']}, sp_rank {r['sp_rank']})"
        assert_close_losses(r["losses"], ref[r["dp_rank"]], what)
        assert_close_losses(r["grad_norms"], ref_norms, what, NORM_REL, "gradient norm")
        assert ("checkpointing" in r["memory_features"]) == (kind == "hybrid"), (what, r["memory_features"])


def test_vision_language_training_on_random_images_matches_plain_data_parallel(pool, tmp_path, model_dirs):
    """--images 3: every row of a tiny Qwen2.5-VL holds three random images whose 4 placeholders each are
    centred on 16, 32 and 48 (every zigzag boundary at P=2); dp 2 x sp 2, ZeRO-2: the losses and gradient
    norms of plain data parallelism over the unsharded model (the same images, the model's own 3-D
    positions), step for step."""
    args = dict(HF_TINY, model=model_dirs["vlm"], deepspeed_config=shipped_config("zigzag"), images=3,
                image_grid="1,4,4")
    results = pool.run(_train, dict(args, run_dir=str(tmp_path)))
    ref, ref_norms = reference_losses(args, 2)
    for r in results:
        what = f"--model qwen2_5_vl --images 3 rank {r['rank']} (dp_rank {r['dp_rank']})"
        assert_close_losses(r["losses"], ref[r["dp_rank"]], what)
        assert_close_losses(r["grad_norms"], ref_norms, what, NORM_REL, "gradient norm")


def test_hf_checkpoint_resume_reproduces_losses(pool, tmp_path, model_dirs):
    base = dict(HF_TINY, model=model_dirs["weights"], deepspeed_config=shipped_config("striped"), steps=4,
                run_dir=str(tmp_path / "runs"))
    save = str(tmp_path / "ckpt")
    whole = pool.run(_train, base)
    pool.run(_train, dict(base, steps=2, save_dir=save, save_interval=2))
    resumed = pool.run(_train, dict(base, save_dir=save, resume=True))
    for w, r in zip(whole, resumed):
        assert r["start_step"] == 2, r
        assert_close_losses(r["losses"], w["losses"][2:], f"--model rank {r['rank']} resumed at step 2")


def _readme_recipe(model_dir, ds, opts, hf_deepspeed_config=False):
    """The README's five lines (model(**batch).loss under DeepSpeed), on the main job's batches.
    ``hf_deepspeed_config``: from_pretrained with transformers' HfDeepSpeedConfig alive, which under
    ZeRO-3 builds the model inside deepspeed.zero.Init over the whole world."""
    import deepspeed
    from ds_seqpar import SequenceParallel, comm
    from ds_seqpar.hf import apply_sequence_parallel
    from ds_seqpar.hf.model_io import load_causal_lm
    from ds_seqpar.train import data
    deepspeed.init_distributed(dist_backend=comm.backend_name())
    tokens = data.stdlib_corpus(opts["corpus_bytes"])
    sp = SequenceParallel.from_ds_config(ds)
    hf_ds = None
    if hf_deepspeed_config:
        from transformers.integrations import HfDeepSpeedConfig
        hf_ds = HfDeepSpeedConfig(ds)           # must stay referenced until the model is built
    try:
        model = load_causal_lm(model_dir)[0].train()
    finally:
        if hf_ds is not None:
            # transformers keeps a process-wide weak reference: the pool's next test must not see ZeRO-3
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config
            unset_hf_deepspeed_config()
    partitioned = all(hasattr(p, "ds_id") and p.ds_numel > p.ds_tensor.numel() for p in model.parameters()) \
        if hf_deepspeed_config else None
    model = apply_sequence_parallel(model, sp)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds, mpu=sp.mpu)
    losses, norms = [], []
    for step in range(opts["steps"]):
        batch = data.batch_for_step(tokens, step, 0, sp.dp_rank, sp.dp_size, ds["train_micro_batch_size_per_gpu"],
                                    opts["seq_len"], opts.get("seed", 0), opts["ignore_frac"])
        batch = sp.shard_batch(batch)
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    engine.destroy()
    return {"losses": losses, "grad_norms": norms, "dp_rank": sp.dp_rank, "rank": comm.global_rank(),
            "partitioned": partitioned}


def test_readme_hf_recipe_matches_plain_data_parallel(pool, model_dirs):
    ds = shipped_config("zigzag")
    ds.pop("wandb")
    results = pool.run(_readme_recipe, model_dirs["weights"], ds, HF_TINY)
    ref, _ = reference_losses(dict(HF_TINY, model=model_dirs["weights"], deepspeed_config=ds), 2)
    for r in results:
        assert_close_losses(r["losses"], ref[r["dp_rank"]], f"README recipe rank {r['rank']}")


def test_hf_deepspeed_config_zero3_from_pretrained_matches_plain_data_parallel(pool, model_dirs):
    """Hugging Face's ZeRO-3 path: HfDeepSpeedConfig alive, from_pretrained loads the weights into a
    model built under zero.Init over the whole world; then the plain recipe trains it exactly."""
    pytest.importorskip("accelerate", reason="transformers' HfDeepSpeedConfig needs accelerate (in [test])")
    ds = shipped_config("zigzag")
    ds.pop("wandb")
    ds["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    results = pool.run(_readme_recipe, model_dirs["weights"], ds, HF_TINY, True)
    assert all(r["partitioned"] for r in results), "from_pretrained did not build the model under zero.Init"
    ref, ref_norms = reference_losses(dict(HF_TINY, model=model_dirs["weights"], deepspeed_config=ds), 2)
    for r in results:
        what = f"HfDeepSpeedConfig ZeRO-3 rank {r['rank']}"
        assert_close_losses(r["losses"], ref[r["dp_rank"]], what)
        assert_close_losses(r["grad_norms"], ref_norms, what, NORM_REL, "gradient norm")


def _main(argv):
    from ds_seqpar.train.main import main
    return main(argv)


def test_readme_command_trains_the_shipped_llama(pool, tmp_path):
    """`python -m ds_seqpar.train --model configs/models/llama_small.json --deepspeed_config
    configs/zigzag_zero2.json`, shortened (the launcher already started the pool's ranks)."""
    argv = ["--model", os.path.join(ROOT, "configs", "models", "llama_small.json"), "--deepspeed_config",
            os.path.join(CONFIGS, "zigzag_zero2.json"), "--steps", "2", "--seq_len", "64", "--corpus_bytes",
            str(1 << 16), "--no_wandb", "--quiet", "--run_dir", str(tmp_path)]
    assert pool.run(_main, argv) == [0, 0, 0, 0]


@pytest.mark.parametrize("override,expected", [
    ({"strategy": "lasp"}, "with sequence_parallel.strategy='lasp': Hugging Face models use softmax attention"),
    ({"vocab_size": 4000, "data": "TOKENS"}, "has vocab_size=256, smaller than the training data's vocabulary (4000"),
], ids=["lasp", "vocab"])
def test_bad_hf_run_stops_every_rank_with_one_message(pool, tmp_path, model_dirs, override, expected):
    import numpy as np
    if override.get("data") == "TOKENS":
        override = dict(override, data=str(tmp_path / "tokens.bin"))
        np.arange(3000, dtype=np.uint16).tofile(override["data"])
    run_dir = tmp_path / "runs"
    args = dict(HF_TINY, model=model_dirs["weights"], deepspeed_config=shipped_config("zigzag"),
                run_dir=str(run_dir), **override)
    assert_refused_before_training(pool.run(config_error_of, args), expected, run_dir)
