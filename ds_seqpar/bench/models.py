"""``ds-seqpar bench models``: two of 2026's long-context model kinds, a training step at P ranks against the
unsharded model on one rank, through the bench harness (harness.py: interleaved rounds after a barrier, one
thread per rank, rows and page by report/render.py):

  dsa  DeepSeek-V3.2-style indexed attention (hf/indexed.py): a one-layer DeepseekV32 model (hidden 256,
       4 heads, MLA latents 64 + 16, indexer 4 heads x 32, top-k 1024), N tokens of text;
  vlm  a Qwen2.5-VL-style tiny model (text: hidden 256, 4 layers, 8 heads, 4 k/v heads; vision tower:
       2 blocks of hidden 64), N tokens of which one video's placeholders (grid 8 x 32 x 32 patches:
       2048 tokens); the tower runs whole on every rank (hf/vision.py), the language model sharded.

Per round: "unsharded" (rank 0, the unapplied model on the whole row, the others waiting) then the
applied model under --strategy on every rank; speedup = unsharded / sharded per round, median (min-max).
Bytes per rank of the sharded step against strategies/closed_form.py: dsa ``indexed_attention_bytes``,
vlm the strategy's ``closed_form_by_kind`` times the text layers (other kinds, the whole row's token
ids and the loss, listed beside). reports/long_context_models_cpu.md came from

    ds-seqpar bench models --repeats 3
"""
from __future__ import annotations

import copy
from typing import Dict, List, Optional

from ..report.rows import Row
from .harness import (case_times, command_line, measure_on_pool, rank_rounds, suite_facts, suite_main, suite_parser,
                      versus, write_page)

PROG = "ds-seqpar bench models"
CASES = ("dsa", "vlm")
DSA = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
           q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, index_n_heads=4,
           index_head_dim=32, index_topk=1024, first_k_dense_replace=1, vocab_size=256, attention_dropout=0.0,
           use_cache=False)
VLM_TEXT = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, head_dim=32, vocab_size=2048, attention_dropout=0.0, use_cache=False,
                bos_token_id=1, eos_token_id=2, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]})
VLM_VISION = dict(patch_size=2, spatial_merge_size=2, temporal_patch_size=2, in_channels=3, depth=2, hidden_size=64,
                  intermediate_size=128, num_heads=2, out_hidden_size=256, window_size=8, fullatt_block_indexes=[1],
                  tokens_per_second=2)
VLM_TOKENS = dict(image_token_id=2040, video_token_id=2041, vision_start_token_id=2042, vision_end_token_id=2043)
VIDEO_GRID = (8, 32, 32)             # (t, h, w) in patches: t * h * w / 4 placeholders after the 2 x 2 merge


def _models(auto, cfg, args):
    """The unsharded model and an equal copy with sequence parallelism applied, and its SequenceParallel."""
    import torch

    from ..hf import apply_sequence_parallel
    from ..sequence_parallel import SequenceParallel
    torch.manual_seed(0)
    plain = auto.from_config(cfg, attn_implementation="sdpa").train()
    sharded = auto.from_config(copy.deepcopy(cfg), attn_implementation="sdpa").train()
    sharded.load_state_dict(plain.state_dict())
    sp = SequenceParallel({"strategy": args.strategy, "size": args.P})
    apply_sequence_parallel(sharded, sp)
    return plain, sharded, sp


def _dsa(args):
    """(unsharded model, its inputs, applied model, its sharded batch, sp). Each model its own config:
    applying sequence parallelism changes the attention implementation its config names."""
    import torch
    import transformers as T
    cfg = T.DeepseekV32Config(**dict(DSA, max_position_embeddings=args.seq))
    plain, sharded, sp = _models(T.AutoModelForCausalLM, cfg, args)
    ids = torch.randint(0, cfg.vocab_size, (1, args.seq), generator=torch.Generator().manual_seed(1))
    whole = dict(input_ids=ids, labels=ids, position_ids=torch.arange(args.seq)[None])
    return plain, whole, sharded, sp.shard_batch({"input_ids": ids, "labels": ids}), sp


def vlm_config():
    from transformers import Qwen2_5_VLConfig
    return Qwen2_5_VLConfig(text_config=dict(VLM_TEXT, max_position_embeddings=1 << 16),
                            vision_config=dict(VLM_VISION), **VLM_TOKENS)


def _vlm(args):
    """As _dsa: a row of text with one video's placeholders after its first eighth."""
    import torch
    import transformers as T
    cfg = vlm_config()
    plain, sharded, sp = _models(T.AutoModelForImageTextToText, cfg, args)
    g = torch.Generator().manual_seed(1)
    v = cfg.vision_config
    grid = torch.tensor([VIDEO_GRID])
    width = v.in_channels * v.temporal_patch_size * v.patch_size ** 2          # one patch's pixels, flattened
    vision = {"pixel_values_videos": torch.randn(int(grid.prod()), width, generator=g), "video_grid_thw": grid,
              "second_per_grid_ts": torch.tensor([1.0])}
    ids = torch.randint(3, 2000, (1, args.seq), generator=g)
    types = torch.zeros_like(ids)
    start, n = args.seq // 8, int(grid.prod()) // v.spatial_merge_size ** 2
    ids[0, start:start + n], types[0, start:start + n] = cfg.video_token_id, 2
    labels = ids.masked_fill(types > 0, -100)
    pos = plain.model.get_rope_index(ids, mm_token_type_ids=types, video_grid_thw=grid,
                                     second_per_grid_ts=vision["second_per_grid_ts"])[0]
    whole = dict(vision, input_ids=ids, labels=labels, position_ids=pos, mm_token_type_ids=types)
    return plain, whole, sharded, sp.shard_batch(dict(whole)), sp


def _case_fns(args, rank: int):
    """{(case, variant): (fwd+bwd or None on this rank, stats or None)}; the models live in the closures."""
    fns = {}
    for case in args.cases:
        plain, whole, sharded, batch, sp = {"dsa": _dsa, "vlm": _vlm}[case](args)
        fns[case, "unsharded"] = ((lambda m=plain, b=whole: m(**b).loss.backward()) if rank == 0 else None, None)
        fns[case, args.strategy] = (lambda m=sharded, b=batch: m(**b).loss.backward(), sp.stats)
    return fns


def bench_rank(args):
    import torch
    torch.set_num_threads(1)
    return rank_rounds(args, _case_fns)


def closed_forms(case: str, args) -> List[Dict[str, int]]:
    """{CommStats kind: bytes} per rank the closed forms give for one step of ``case``'s model."""
    from ..strategies.closed_form import Shapes, closed_form_by_kind, indexed_attention_bytes
    if case == "dsa":
        one = indexed_attention_bytes(args.P, 1, args.seq, DSA["kv_lora_rank"] + DSA["qk_rope_head_dim"],
                                      DSA["index_head_dim"], 4)
        return [{k: DSA["num_hidden_layers"] * v for k, v in one.items()}] * args.P
    t = VLM_TEXT
    sh = Shapes(1, args.seq, t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"], 4)
    return [{k: t["num_hidden_layers"] * v for k, v in closed_form_by_kind(args.strategy, args.P, sh, r).items()}
            for r in range(args.P)]


def rows(per_rank, args, meta) -> List[Row]:
    out = []
    for case in args.cases:
        base, mine = case_times(per_rank, f"{case}/unsharded"), case_times(per_rank, f"{case}/{args.strategy}")
        s = versus(base, mine)
        out.append(Row("models", case, f"{args.strategy} P={args.P}", f"Training step at N={args.seq}: speedup over "
                       "the unsharded model", "x", s["ratio"], tuple(s["ratio_range"]), bound=args.P,
                       detail={"unsharded wall s": base["time"], "sharded wall s": mine["time"],
                               "CPU speedup": s["cpu_ratio"], "CPU s per rank": mine["cpu"]}))
        want = closed_forms(case, args)
        sent = [r["rounds"][f"{case}/{args.strategy}"][-1]["by_kind"] for r in per_rank]
        out.append(Row("models", case, f"{args.strategy} P={args.P}", "Bytes per rank against the closed form", "B",
                       [sum(b.get(k, 0) for k in w) for b, w in zip(sent, want)],
                       predicted=[sum(w.values()) for w in want], target="bytes",
                       detail={"kinds": ", ".join(sorted(want[0])),
                               "other kinds (B, rank 0)": ", ".join(f"{k} {v}" for k, v in sorted(sent[0].items())
                                                                    if k not in want[0]) or "none"}))
    return out


def facts(meta) -> dict:
    return suite_facts(
        meta, "Long-context models on CPU ranks: DeepSeek sparse attention and a video-language model",
        f"P={meta['P']} ranks x 1 thread (gloo), N={meta['seq']} tokens, batch 1, fp32, one training step (forward "
        f"+ backward of the model's own loss), strategy {meta['strategy']}, transformers' SDPA path; "
        f"{meta['repeats']} interleaved rounds after {meta['warmup']} warm-up round(s). dsa: a one-layer DeepseekV32 "
        f"({', '.join(f'{k}={v}' for k, v in DSA.items() if k not in ('use_cache', 'attention_dropout'))}). vlm: "
        f"Qwen2_5_VL, text {VLM_TEXT['num_hidden_layers']} layers x hidden {VLM_TEXT['hidden_size']}, "
        f"{VLM_TEXT['num_attention_heads']} / {VLM_TEXT['num_key_value_heads']} heads of {VLM_TEXT['head_dim']}; "
        f"vision depth {VLM_VISION['depth']} x hidden {VLM_VISION['hidden_size']}; one video of grid {VIDEO_GRID} "
        f"patches ({VIDEO_GRID[0] * VIDEO_GRID[1] * VIDEO_GRID[2] // 4} placeholder tokens).", {
            f"Training step at N={meta['seq']}: speedup over the unsharded model":
                "Per round: rank 0 runs the unapplied model on the whole row (the other ranks wait), then every "
                "rank the applied model on its shard; the ratio of the two wall times (the slowest rank's), "
                "median (min-max); CPU speedup: the same with the busiest rank's thread CPU time, which other jobs' "
                "load disturbs less. The bound is P: the vlm's vision tower is not split (it runs whole on every "
                "rank), nor is the dsa's latent expansion (every rank expands all N latents).",
            "Bytes per rank against the closed form":
                "What CommStats recorded per rank in the last round, the closed form's kinds only: dsa "
                "`indexed_attention_bytes` (dsa_latent, dsa_index_keys) per layer; vlm the strategy's "
                "`closed_form_by_kind` per text layer."})


def build_parser():
    ap = suite_parser(PROG, __doc__, "long_context_models_cpu", repeats=3, P=2, seq=8192)
    ap.add_argument("--strategy", default="zigzag", help="the softmax strategy of the sharded runs")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    return ap


def measure(args, argv: List[str]) -> int:
    import transformers
    args.cases = tuple(c for c in args.cases.split(",") if c)
    if not args.cases or set(args.cases) - set(CASES) or args.seq % (2 * args.P):
        raise SystemExit(f"{PROG}: --cases {args.cases} must name some of {', '.join(CASES)}; --seq {args.seq} a "
                         f"multiple of 2 x --P {args.P}")
    per_rank, meta = measure_on_pool(bench_rank, args, command_line(PROG, argv),
                                     versions=True)
    meta.update(transformers=transformers.__version__)
    return write_page(args.out, meta["name"], rows(per_rank, args, meta), dict(facts(meta), meta=meta), PROG)


def main(argv: Optional[List[str]] = None) -> int:
    return suite_main(argv, build_parser(), measure)


__all__ = ["main", "CASES"]
