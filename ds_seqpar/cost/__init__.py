"""The cost model: the one place that turns (model shape, mask, layout, candidate) into pairs per
rank, bytes, FLOPs, memory, time and the price of a document. The dynamic scheduler places documents
with it (documents.py), ``ds-seqpar plan`` ranks candidates and places documents with it,
``--calibrate`` checks it against the measured reports, bench writes its bounds and expected columns
from it.

    model_shape.py the one reader of a model's sizes: ModelShape (the own LM: of_lm; a Hugging Face
                  config: from_hf_config)
    candidate.py  what is priced: Candidate (layout, sizes, ZeRO stage), Features, the layer kinds
    documents.py  a document alone on a group: its work (linear and attention FLOPs, bytes) and price,
                  the scheduler's and the planner's alike (DocumentPricer; gpu_rates)
    pairs.py      the (q, k) pairs each rank computes under a mask; speedup bounds; the kernel's
                  computed pairs (whole key tiles)
    bytes.py      bytes per rank and per layer kind (the closed forms; a mask's key spans read from the
                  runtime's MaskPlan)
    flops.py      FLOPs per token per layer kind
    memory.py     static memory by ZeRO stage, bytes per token per phase, the phase model's peak
    decode.py     generation with a sequence-sharded cache: the decode merge's and prefill logits' bytes, the
                  cache per rank
    times.py      alpha-beta collectives, compute from FLOPs, kernel calls priced per call and pair
    steps.py      a step of rounds: per-round and per-step terms, a document's GPU seconds, fitted rates
    chunks.py     Ulysses' head chunks: the exposed all-to-all of C chunks, "auto"'s count

It imports the core only (tests/unit/test_layers.py gives it the core's layer), so the runtime may
price with it; the mask is ds_seqpar/masks.py's Mask; a GPU is read by attribute (plan.hardware.Gpu).
tests/reference.py counts pairs and spans by enumeration (and derives the key spans key by key), the
oracles the tests hold this and strategies/closed_form.py to.
"""
from .bytes import SPAN_BUDGET, busiest_bytes, comm_per_layer, exact_spans, layer_mask, rank_bytes
from .decode import decode_merge_bytes, decode_step_bytes, kv_cache_bytes, prefill_logits_bytes
from .candidate import LINEAR_KINDS, SOFTMAX_KINDS, Candidate, Features
from .documents import DocumentPricer, gpu_rates, price, work
from .model_shape import ModelShape, from_hf_config
from .flops import keys_per_query, model_flops_per_token, step_per_token
from .memory import PHASES, fit_line, max_tokens, peak, phase_lines, phase_model
from .pairs import (busiest_keys_per_token, computed_pairs, expected_imbalance, imbalance, layout_of,
                    pairs_per_rank, pairs_total, position_pairs, sharded_length, speedup_bound)

__all__ = ["busiest_bytes", "busiest_keys_per_token", "Candidate", "comm_per_layer", "computed_pairs",
           "decode_merge_bytes", "decode_step_bytes", "DocumentPricer", "exact_spans", "expected_imbalance",
           "Features", "fit_line", "from_hf_config", "gpu_rates", "imbalance", "keys_per_query", "kv_cache_bytes",
           "layer_mask", "layout_of", "LINEAR_KINDS", "max_tokens", "model_flops_per_token", "ModelShape",
           "pairs_per_rank", "pairs_total", "peak", "phase_lines", "phase_model", "PHASES", "position_pairs",
           "prefill_logits_bytes", "price", "rank_bytes", "sharded_length", "SOFTMAX_KINDS", "SPAN_BUDGET",
           "speedup_bound", "step_per_token", "work"]
