"""The main job's --images (ds_seqpar/train/images.py), without processes: where the placeholders go,
that a row's images depend on its global index only (so replicas of any size draw the same ones), the
model's own 3-D positions, and the options it refuses by name."""
import pytest
import torch

from ds_seqpar import SequenceParallelConfig
from ds_seqpar.train import data, documents, hf_model
from ds_seqpar.train.args import DEFAULT_DS_CONFIG, TrainConfigError, resolve_args
from ds_seqpar.train.images import RandomImages
from ds_seqpar.train.main import load_hf_config

from ..zoo.vlm import CONFIGS, build

SEQ = 64


def _qwen(image_token_id=260):
    cfg = CONFIGS["qwen2_5_vl"]()
    cfg.text_config.vocab_size, cfg.image_token_id = 300, image_token_id
    return cfg


def _rows(images, rows, first_row, step=1):
    tokens = data.stdlib_corpus(1 << 14)
    batch = data.batch_for_step(tokens, step, 0, 0, 1, rows, SEQ)
    return images.batch(batch, 0, step, 0, first_row)


def test_images_take_their_slots_and_a_row_draws_the_same_pixels_in_any_replica_split():
    cfg = _qwen()
    images = RandomImages(cfg, 3, (1, 4, 4), SEQ, 256).attach(build(cfg, torch.float32))
    both = _rows(images, 2, 0)
    slots = torch.zeros(SEQ, dtype=torch.bool)
    for centre in (16, 32, 48):                     # 4 placeholders each, centred on the zigzag boundaries at P=2
        slots[centre - 2:centre + 2] = True
    assert (both["input_ids"][:, slots] == 260).all() and not (both["input_ids"][:, ~slots] == 260).any()
    assert (both["labels"][:, slots] == data.IGNORE_INDEX).all() and (both["mm_token_type_ids"] == slots).all()
    assert both["pixel_values"].shape == (2 * 3 * 16, 3 * 2 * 2 * 2)          # rows x images x patches, C x tp x p x p
    assert both["image_grid_thw"].tolist() == [[1, 4, 4]] * 6
    pos = both["position_ids"]
    assert pos.shape == (3, 2, SEQ) and not torch.equal(pos[1], pos[2]), "image tokens get 2-D positions"
    # global row 1 alone (a replica of micro batch 1) draws what row 1 of the pair drew
    second = _rows(images, 1, 1)
    assert torch.equal(second["pixel_values"], both["pixel_values"][48:])
    assert not torch.equal(_rows(images, 1, 0, step=2)["pixel_values"], both["pixel_values"][:48])


@pytest.mark.parametrize("make,kw,expected", [
    (lambda: CONFIGS["llava"](), {}, "random images are built for Qwen-VL-style grid models only"),
    (lambda: _qwen(image_token_id=100), {}, "image_token_id=100 inside the training data's vocabulary (256 ids)"),
    (_qwen, {"count": 7, "grid": (1, 4, 8)}, "--images=7 of --image_grid=1,4,8 (8 placeholders each) do not fit"),
    (_qwen, {"grid": (1, 3, 4)}, "--image_grid=1,3,4: h and w must be multiples of the model's spatial_merge_size=2"),
], ids=["not a grid model", "token in vocabulary", "too many", "merge"])
def test_images_that_cannot_be_built_are_refused_by_name(make, kw, expected):
    kw = dict({"count": 3, "grid": (1, 4, 4)}, **kw)
    with pytest.raises(TrainConfigError, match=expected.replace("(", "\\(").replace(")", "\\)")):
        RandomImages(make(), kw["count"], kw["grid"], SEQ, 256)


def test_images_options_that_do_not_go_together_are_refused():
    sp_cfg = SequenceParallelConfig.from_ds_config(DEFAULT_DS_CONFIG)
    with pytest.raises(TrainConfigError, match="--images=2 needs a vision-language --model"):
        load_hf_config(resolve_args({"images": 2}), sp_cfg, DEFAULT_DS_CONFIG)
    with pytest.raises(TrainConfigError, match="--images=2 with --lengths: packed documents with images"):
        documents.check_options(resolve_args({"images": 2, "lengths": "x.txt"}), sp_cfg, None)
    from transformers import LlamaConfig
    with pytest.raises(TrainConfigError, match="llama is not a vision-language model; use --images 0"):
        hf_model.check_run(None, resolve_args({"images": 2, "model": "m"}), LlamaConfig(vocab_size=300), 256)
    with pytest.raises(TrainConfigError, match="--images=1 with --compile: vision-language models under torch.compile"):
        RandomImages.of(resolve_args({"images": 1, "compile": "eager"}), _qwen(), 256)
    with pytest.raises(TrainConfigError, match="--images=1 with sequence_parallel.tiled_loss_tokens=512: the tiled"):
        RandomImages.of(resolve_args({"images": 1}), _qwen(), 256, tiled_loss_tokens=512)
    with pytest.raises(TrainConfigError, match="--image_grid='1,8' must be three positive integers"):
        RandomImages.of(resolve_args({"images": 1, "image_grid": "1,8"}), _qwen(), 256)


def test_shipped_vision_language_config_loads_and_takes_the_default_images():
    import os
    from ds_seqpar.hf.checks import check_config
    from ds_seqpar.hf.model_io import load_config
    path = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "configs", "models", "vision",
                        "qwen2_5_vl_small.json")
    cfg = load_config(path)
    assert hf_model.is_vision_language(cfg) and cfg.text_config.hidden_size == 256
    check_config(cfg, training=True, vision_ok=True)
    images = RandomImages.of(resolve_args({"images": 2, "seq_len": 1024}), cfg, 256)
    assert images.per_image == 16 and images.width == 3 * 2 * 14 * 14
