"""Vision-language models (tests/zoo/vlm.py) on the shared pool: each family trains one step exactly under
every softmax strategy at P=2 (logits, loss, every gradient incl. the vision tower's), with image and video
placeholders straddling the shard boundaries (Gemma 3's bidirectional image blocks also at P=4 and in the
2D hybrid; Llama 4's chunked layer and NoPE layer with temperature tuning from global positions; GLM-4.6V's
video frames at image placeholders; Granite 4 Vision's deepstack features keyed by decoder layer; each tower's
merge, ERNIE's paired frames and HunYuan's row-end placeholders through the grid check; Gemma 4 Unified's blocks on every layer; Molmo2's one group of image tokens; Mllama's images through
cross-attention); bad vision inputs stop every rank with the input named."""
import torch

from ..zoo.vlm import CONFIGS, STRATEGIES, build, check_vlm, positions, row, sweep, train_vlm
from .test_hf_trainer import assert_same_training, ds_config

# smolvlm is idefics3's code under another name; glm4v, glm_ocr, glm4v_moe, glmga and qwen3_vl_moe share the
# vision path of glm46v and qwen3_vl; minicpmv4_6 / 4_7, qwen3_5, qwen3_5_moe, the Omni thinkers, step3p7 and
# qwen4_exp (refused), muse_spark (muse_glimmer's tower), janus (LLaVA's path) and emu3 (a visual vocabulary, as
# ovis2) add no path of ours either (the sweep script, tests/zoo/vlm_table.py, covers them)
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "llava_next", "mistral3", "idefics3", "gemma3", "gemma4",
            "llama4", "glm46v", "fuyu", "llava_onevision", "llava_next_video", "video_llava", "idefics2", "cohere2_vision",
            "deepseek_vl", "ovis2", "aria", "kimi_k25", "muse_glimmer", "video_llama_3", "paddleocr_vl", "minimax_m3_vl",
            "dots3_note", "cohere_compass", "cosmos3_omni", "exaone4_5", "hyperclovax_vision_v2", "lfm3_vl",
            "deepseek_vl_hybrid", "granite_docling", "lfm2_vl", "qianfan_ocr", "shieldgemma2", "mistral_large4",
            "minicpm_ocr", "gemma4_unified", "nemotron_h_omni", "hunyuan_vl", "ernie4_5_vl_moe", "mllama", "unlimited_ocr",
            "blip-2", "instructblip", "granite4_vision", "molmo2")
# hybrids whose convolution / linear layers need runs of tokens: striped refused by name (docs/hybrids.md)
EXCEPT_STRIPED = ("lfm3_vl", "minicpm_ocr", "nemotron_h_omni")


def test_vision_language_models_are_exact_under_every_strategy(pool):
    results = pool.run(sweep, FAMILIES)
    for a, b in ((0, 1), (2, 3)):                        # the two ranks of each sequence group
        assert [(n, {s: o[0] for s, o in r.items()}) for n, r in results[a]] == \
            [(n, {s: o[0] for s, o in r.items()}) for n, r in results[b]], "ranks of one group disagree"
    outcome = dict(results[0] + results[2])
    assert sorted(outcome) == sorted(FAMILIES)
    for name, r in outcome.items():
        assert sorted(r) == sorted(STRATEGIES)
        if any("breaks" in m and "transformers" in m for kind, m in r.values() if kind == "refused"):
            # a release that breaks the family by itself (hf/versions.UPSTREAM_BREAKS): refused by name
            assert all(kind == "refused" and "use transformers>=5.23.0" in m for kind, m in r.values()), (name, r)
            continue
        if name in EXCEPT_STRIPED:
            kind, message = r.pop("striped")
            assert kind == "refused" and "strategy='striped'" in message, (name, kind, message)
        assert all(kind == "exact" for kind, _ in r.values()), (name, r)


def _gemma3_at_four():
    from ds_seqpar import SequenceParallel
    cfgs = {s: {"strategy": s, "size": 4} for s in STRATEGIES}
    cfgs["zigzag 2x2"] = {"strategy": "zigzag", "size": 4, "ulysses_size": 2}
    return check_vlm("gemma3", {name: SequenceParallel(cfg) for name, cfg in cfgs.items()})


def test_gemma3_image_blocks_are_exact_at_four_ranks(pool):
    """Each of the three images' 9 bidirectional tokens straddles a boundary of every layout at P=4."""
    results = pool.run(_gemma3_at_four)
    assert all(r == results[0] for r in results), "ranks of the group disagree"
    assert sorted(results[0]) == sorted(STRATEGIES + ("zigzag 2x2",)), results[0]
    assert all(kind == "exact" for kind, _ in results[0].values()), results[0]


def _bad_inputs():
    """Every rank: the message each bad call raised (or None), then a good call's loss."""
    from ds_seqpar import SequenceParallel
    from ds_seqpar.hf import apply_sequence_parallel
    sp = SequenceParallel({"strategy": "zigzag", "size": 2})
    cfg = CONFIGS["qwen2_vl"]()
    model = apply_sequence_parallel(build(cfg, torch.float32), sp)
    ids, labels, types, vision = row(cfg, model)
    pos = positions(model, ids, types, vision)

    def call(ids=ids, pos=pos, **changed):
        batch = sp.shard_batch(dict(vision, input_ids=ids, labels=labels, mm_token_type_ids=types))
        return model(**dict(batch, position_ids=pos, **changed))

    fewer = ids.clone()
    fewer[fewer == cfg.image_token_id] = 5
    cases = {
        "grid": dict(image_grid_thw=torch.tensor([[1, 4, 4], [1, 4, 4]])),          # 32 patch rows given
        "placeholders": dict(ids=fewer),
        "text positions": dict(pos=sp.position_ids(ids.shape[1])[None]),
        "unsharded positions": dict(pos=pos),
    }
    out = {}
    for name, kw in cases.items():
        if name != "unsharded positions":
            kw.setdefault("pos", sp.shard(pos, dim=-1))
        out[name] = _refusal(lambda: call(**kw))
    good = call(pos=sp.shard(pos, dim=-1))
    out["placeholders (llava)"] = _llava_placeholders(sp)
    out["image past the window"] = _gemma4_unified_long_image(sp)
    out["two image runs"] = _molmo2_two_images(sp)
    return out, float(good.loss.detach()), _gemma3_image_blocks(sp)


def _llava_placeholders(sp):
    """A model without grids: transformers' own count check, on the whole row every rank gathers alike."""
    from ds_seqpar.hf import apply_sequence_parallel
    cfg = CONFIGS["llava"]()
    model = apply_sequence_parallel(build(cfg, torch.float32), sp)
    ids, labels, _, vision = row(cfg, model)
    ids = ids.clone()
    ids[0, (ids[0] == cfg.image_token_id).nonzero()[0]] = 5          # one placeholder short
    return _refusal(lambda: model(**sp.shard_batch(dict(vision, input_ids=ids, labels=labels))))


def _gemma4_unified_long_image(sp):
    """Gemma 4 Unified with one image of 9 tokens, longer than its sliding window of 8: refused."""
    from ds_seqpar.hf import apply_sequence_parallel
    cfg = CONFIGS["gemma4_unified"]()
    model = apply_sequence_parallel(build(cfg, torch.float32), sp)
    ids = torch.randint(3, 100, (1, 64))
    ids[0, 28:37] = cfg.image_token_id
    y, x = torch.meshgrid(torch.arange(3), torch.arange(3), indexing="ij")
    vision = {"pixel_values": torch.randn(1, 9, 12), "image_position_ids": torch.stack([x.flatten(), y.flatten()], -1)[None]}
    return _refusal(lambda: model(**sp.shard_batch(dict(vision, input_ids=ids, labels=ids,
                                                        mm_token_type_ids=(ids == cfg.image_token_id).long()))))


def _molmo2_two_images(sp):
    """Molmo2 with two images apart: every image token sees every other across the text between them, refused."""
    from ds_seqpar.hf import apply_sequence_parallel
    cfg = CONFIGS["molmo2"]()
    model = apply_sequence_parallel(build(cfg, torch.float32), sp)
    ids, _, _, vision = row(cfg, model)
    ids = ids.clone()
    ids[0, 10:14] = cfg.image_token_id
    vision = {k: torch.cat([v, v]) for k, v in vision.items()}
    vision["image_token_pooling"][4:] += 16
    return _refusal(lambda: model(**sp.shard_batch(dict(vision, input_ids=ids, labels=ids,
                                                        mm_token_type_ids=(ids == cfg.image_token_id).long()))))


def _gemma3_image_blocks(sp):
    """Gemma 3 image tokens (token_type_ids) that one mask cannot hold, on one rank's shard only: two rows with
    images at different positions, and images in packed documents. Every rank refuses each."""
    from ds_seqpar.hf import apply_sequence_parallel
    from ..zoo.decoders import tiny_config
    model = apply_sequence_parallel(build(tiny_config("gemma3"), torch.float32), sp)
    ids = torch.randint(3, 100, (2, 64))
    types = torch.zeros_like(ids)
    types[0, 40:44] = 1                      # zigzag at P=2: rank 1 holds 16..47, rank 0 none of them
    types[1, 8:12] = 1
    packed = torch.cat([torch.arange(36), torch.arange(28)])[None]
    return [_refusal(lambda: model(**sp.shard_batch(batch))) for batch in (
        {"input_ids": ids, "labels": ids, "token_type_ids": types},
        {"input_ids": ids[:1], "labels": ids[:1], "token_type_ids": types[:1], "position_ids": packed})]


def _refusal(run):
    """The message of the ValueError run() raised (a sharded model call), None if it ran."""
    try:
        run()
    except ValueError as err:
        return str(err)
    return None


def test_bad_vision_inputs_stop_every_rank_with_the_input_named(pool):
    results = pool.run(_bad_inputs)
    assert all(r[0] == results[0][0] for r in results), "ranks raised different errors"
    errors = results[0][0]
    assert "image_grid_thw [[1, 4, 4], [1, 4, 4]] does not match pixel_values" in errors["grid"], errors
    assert "input_ids hold 0 image_token_id placeholders" in errors["placeholders"], errors
    assert "position_ids (1, 32) are 1-D text positions" in errors["text positions"], errors
    assert "position_ids (3, 1, 64) do not fit this rank's input_ids (1, 32)" in errors["unsharded positions"], errors
    assert "Image features and image tokens do not match" in errors["placeholders (llava)"], errors
    assert "an image of 9 tokens longer than sliding_window=8 in gemma4_unified" in errors["image past the window"], errors
    assert "image tokens in 2 separate runs [(10, 14), (30, 34)] in molmo2" in errors["two image runs"], errors
    assert len({round(r[1], 6) for r in results}) == 1      # a good call after them: the ranks still agree
    assert all("rows of the batch hold image tokens at different positions in gemma3" in r[2][0] for r in results)
    assert all("image tokens in packed documents in gemma3 cannot be exact" in r[2][1] for r in results), results


def test_trainer_trains_a_qwen2_5_vl_on_random_images_as_plain_data_parallelism(pool):
    """Plain: size 1, 4 replicas, micro batch 1; zigzag size 2: 2 replicas, micro batch 2 (the same
    samples per step, tests/dist/test_hf_trainer.py); ZeRO-2."""
    plain = pool.run(train_vlm, ds_config(2, strategy="zigzag", size=1), 1)[0]
    got = pool.run(train_vlm, ds_config(2, strategy="zigzag", size=2), 2)[0]
    assert_same_training("Qwen2.5-VL zigzag", got, plain)
