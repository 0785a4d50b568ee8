"""hf/vision.py's whole-row checks without processes: a grid against its pixel rows, and the placeholders
against the features the grids give, per the token each model's merge reads (GLM-4V: a video's frames at
image placeholders)."""
from types import SimpleNamespace

import pytest
import torch

from ds_seqpar.hf.vision import check_grids


def _config(model_type):
    return SimpleNamespace(model_type=model_type, image_token_id=120, video_token_id=121,
                           vision_config=SimpleNamespace(spatial_merge_size=2))


def _row(image=0, video=0):
    ids = torch.zeros(1, 64, dtype=torch.long)
    ids[0, :image], ids[0, 32:32 + video] = 120, 121
    return ids


VIDEO = {"pixel_values_videos": torch.zeros(32, 24), "video_grid_thw": torch.tensor([[2, 4, 4]])}   # 8 features
IMAGE = {"pixel_values": torch.zeros(16, 24), "image_grid_thw": torch.tensor([[1, 4, 4]])}           # 4 features


def test_placeholders_are_counted_at_the_token_the_merge_reads():
    check_grids(dict(IMAGE, **VIDEO), _row(image=4, video=8), _config("qwen2_vl"))
    check_grids(VIDEO, _row(image=8), _config("glm46v"))         # GLM: the frames at image placeholders
    with pytest.raises(ValueError, match="input_ids hold 0 image_token_id placeholders .* gives 8 features"):
        check_grids(VIDEO, _row(video=8), _config("glm4v"))
    with pytest.raises(ValueError, match="input_ids hold 4 image_token_id placeholders .*image_grid_thw "
                                         "\\[\\[1, 4, 4\\]\\] and video_grid_thw \\[\\[2, 4, 4\\]\\] gives 12"):
        check_grids(dict(IMAGE, **VIDEO), _row(image=4), _config("glm_ocr"))


def test_a_grid_that_does_not_count_its_pixel_rows_is_refused():
    with pytest.raises(ValueError, match="video_grid_thw \\[\\[2, 4, 8\\]\\] does not match pixel_values_videos"):
        check_grids(dict(VIDEO, video_grid_thw=torch.tensor([[2, 4, 8]])), None, _config("qwen2_vl"))


def test_the_merge_is_read_where_each_tower_keeps_it():
    """A square merge under another name (Muse), a rectangle (Kimi-K2.5), a merge per grid row given as an input
    (VideoLLaMA3): one image of 16 patches, 4 features each way; GLM-GA reads a video's frames at image tokens;
    HunYuan-VL's placeholders are more than its features; ERNIE-4.5-VL pools a video's frames in pairs."""
    def config(**vision):
        return SimpleNamespace(model_type="x", image_token_id=120, video_token_id=121,
                               vision_config=SimpleNamespace(**vision))
    check_grids(IMAGE, _row(image=4), config(merge_size=2))
    check_grids(IMAGE, _row(image=4), config(merge_kernel_size=[2, 2]))
    check_grids(dict(IMAGE, image_merge_sizes=torch.tensor([2])), _row(image=4), config())
    with pytest.raises(ValueError, match="input_ids hold 4 image_token_id placeholders .* gives 16 features"):
        check_grids(dict(IMAGE, image_merge_sizes=torch.tensor([1])), _row(image=4), config(spatial_merge_size=2))
    check_grids(VIDEO, _row(image=8), _config("glmga"))
    check_grids(IMAGE, _row(image=8), _config("hunyuan_vl"))     # row-end placeholders: transformers' own check
    check_grids(dict(IMAGE, **VIDEO), _row(image=4, video=4), config(spatial_merge_size=2, temporal_merge_size=2))
