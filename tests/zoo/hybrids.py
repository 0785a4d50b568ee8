"""Tiny random-init hybrids (linear-attention / convolution layers next to softmax attention), built
from each model's own config class, and the exactness check the hybrid tests run on the pool."""
import torch

SEQ = 152            # N/P is not a multiple of the 64-token chunk (delta rule, SSD) at P = 2 or 4 (nor is N/2P)
_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
_KDA = dict(linear_num_heads=4, linear_head_dim=16, num_key_value_heads=4)
_SSD = dict(mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=64,
            mamba_expand=2, mamba_d_conv=4)
_MAMBA1 = dict(num_hidden_layers=2, state_size=8, time_step_rank=8, expand=2, conv_kernel=4)
HYBRIDS = {
    # model type: (layer_types, config overrides)
    "qwen3_next": (["linear_attention", "full_attention"], _GDN),
    "qwen3_5_text": (["linear_attention", "full_attention"], _GDN),
    "qwen3_5_moe_text": (["linear_attention", "full_attention"], _GDN),
    # dk != dv and beta in [0, 2] (negative eigenvalues of the transition)
    "olmo_hybrid": (["linear_attention", "full_attention"], dict(_GDN, linear_key_head_dim=8)),
    # KDA next to MLA (whose k/v heads equal its q heads)
    "kimi_linear": (["linear_attention", "full_attention"], dict(_KDA, num_experts_per_token=2)),
    "bailing_hybrid": (["linear_attention", "full_attention"], _KDA),
    # Mamba2 SSD (scalar decay per head, data-dependent) next to softmax attention
    # (a layer-types list of None: the family spells its pattern with its own keys)
    "bamba": (None, dict(_SSD, num_hidden_layers=2, attn_layer_indices=[1])),
    "granitemoehybrid": (["mamba", "attention"], _SSD),
    "nemotron_h": (["mamba", "attention", "moe"], _SSD),
    "falcon_h1": (None, dict(_SSD, num_hidden_layers=2, mamba_d_ssm=128)),      # attention || SSD in every layer
    # lightning attention (fixed decay per head and layer), block 256 > a rank's tokens
    "minimax": (["linear_attention", "full_attention"], {}),
    "lfm2": (["conv", "full_attention"], {}),
    "lfm2_moe": (["conv", "full_attention"], {}),
    "lfm3": (["conv", "full_attention"], {}),
    # Mamba-1 selective scans (a diagonal decay per channel and state entry, data-dependent): alone, next to
    # softmax attention (Jamba), and Zamba's per-head scans in every layer with a shared attention block
    "mamba": (None, _MAMBA1),
    "falcon_mamba": (None, _MAMBA1),
    "jamba": (None, dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                         expert_layer_offset=1, mamba_d_state=8, mamba_dt_rank=8)),
    "zamba": (None, dict(num_hidden_layers=2, n_mamba_heads=2, attention_hidden_size=128, attention_head_dim=32,
                         mamba_d_state=8, mamba_dt_rank=8, num_key_value_heads=4,
                         layers_block_type=["linear_attention", "hybrid"])),
    # Bamba with one B/C group for all heads (Granite-4.0-H, Mamba2 checkpoints): Ulysses repeats it
    "bamba, n_groups=1": (None, dict(_SSD, num_hidden_layers=2, attn_layer_indices=[1], mamba_n_groups=1)),
}


# transformers' Mamba-1 scan is a per-token Python loop (forward and backward): shorter rows
SEQ_OF = {"mamba": 32, "falcon_mamba": 32, "jamba": 32, "zamba": 32}


def seq_of(model_type):
    return SEQ_OF.get(model_type, SEQ)


SIZES = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=128, max_position_embeddings=512, moe_intermediate_size=32, num_experts=4,
             num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=32,
             kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
             n_group=1, topk_group=1, first_k_dense_replace=1, attention_dropout=0.0, use_cache=False,
             tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def hybrid_config(model_type, **overrides):
    """The model type's own config class at tiny sizes, with the layer pattern of HYBRIDS; per-layer
    lists of the default config are cut (or extended with their last entry) to that many layers."""
    from transformers import CONFIG_MAPPING
    types, extra = HYBRIDS[model_type]
    cls = CONFIG_MAPPING[model_type.split(",")[0]]          # "bamba, n_groups=1": a variant of bamba
    default = cls()
    values = default.to_dict()
    kw = {k: v for k, v in SIZES.items() if k in values}
    if "qk_rope_head_dim" in values:
        kw.pop("head_dim", None)
    layers = values.get("num_hidden_layers")
    for k, v in values.items():
        if isinstance(v, list) and layers and len(v) == layers and k != "layer_types" and types is not None:
            kw[k] = (v + v[-1:] * len(types))[:len(types)]
    kw.update({k: 0.0 for k, v in values.items() if ("dropout" in k or "jitter" in k) and isinstance(v, float)})
    # copies: some config classes edit the lists they are given in place
    if types is not None:
        kw.update(num_hidden_layers=len(types), layer_types=list(types))
    kw.update(dict(extra, **overrides))
    return cls(**kw)


def build(cfg, dtype, state=None):
    import transformers as T
    torch.manual_seed(0)
    # eager experts: grouped_mm has no float64 kernel, and the reference runs in float64
    try:
        model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", experts_implementation="eager")
    except ValueError:          # no softmax attention to dispatch (Mamba, Falcon-Mamba)
        model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    if state is not None:
        model.load_state_dict(state)
    return model.to(dtype).train()


def batch(vocab, rows=2, seq=SEQ):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, vocab, (rows, seq), generator=g)
    labels = ids.clone()
    labels[torch.rand(rows, seq, generator=g) < 0.2] = -100
    return ids, labels


def unsharded(cfg, state, ids, labels, dtype):
    from ..hf_models import textbook_loss
    model = build(cfg, dtype, state)
    logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None].expand_as(ids)).logits
    loss = textbook_loss(logits, labels)
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                            if p.grad is not None}


def _row_ratio(got, ref, plain, k=10.0, floor=1e-5):
    """(largest error / bound, its row) with the bound of each row of a weight's gradient from that row
    alone: one projection's rows can be 1e-4 of another's (Mamba2's B/C rows beside x and z), and a
    bound from the whole tensor would not see them go wrong."""
    err, scale = ((t.double() - ref.double()).abs().flatten(1).amax(1) for t in (got, plain))
    size = ref.double().abs().flatten(1).amax(1)
    bound = k * scale + floor * size
    ratio = torch.where(bound > 0, err / bound.clamp_min(1e-300), (err > 0) * float("inf"))
    return ratio.max().item(), int(ratio.argmax())


def _worst_ratio(sp, model, res, ref, plain, what, rows=False):
    """(largest error / derived bound, its name) over the unsharded logits, the loss and every
    parameter gradient summed over the sequence group; <= 1 is exact. transformers' linear ops compute
    in fp32 even for fp64 inputs, so the fp64 reference carries fp32 rounding in those layers and the
    fp32-vs-fp64 error of the unsharded model measures only part of it: the bound is 10x that error
    plus 1e-5 x the largest reference entry (about 80 fp32 ulps: sums of a few hundred fp32 terms in
    another order). A wrong state, halo or fold is off by orders of magnitude more
    (test_a_bypassed_seam_and_a_wrong_halo_are_caught). ``rows``: each row of a weight's gradient
    against its own bound too (_row_ratio)."""
    from ..dist.test_hf import _summed_grads
    from .decoders import _worst

    def ratio(got, r, p):
        return _worst(got, r, p, k=10.0, floor=1e-5)
    grads = _summed_grads(model, sp.group)
    assert set(grads) == set(ref[2]), (what, set(grads) ^ set(ref[2]))
    ratios = {"logits": ratio(sp.unshard(res.logits.detach(), dim=1, seq_len=ref[0].shape[1]), ref[0], plain[0]),
              "loss": ratio(res.loss.detach(), ref[1], plain[1])}
    ratios.update({f"grad {n}": ratio(g, ref[2][n], plain[2][n]) for n, g in grads.items()})
    for n, g in grads.items() if rows else ():
        if g.dim() >= 2:
            r, row = _row_ratio(g, ref[2][n], plain[2][n])
            ratios[f"grad {n} row {row}"] = r
    worst = max(ratios, key=ratios.get)
    return ratios[worst], worst


def check_hybrids(cases, checkpointing=False, rows=False):
    """check_hybrid for each (model type, settings) of ``cases``: {model type: results}."""
    return {mt: check_hybrid(mt, settings, checkpointing, rows) for mt, settings in cases}


def check_hybrid(model_type, settings, checkpointing=False, rows=False):
    """[(settings, worst error / bound, what)] for one model type over sequence-parallel settings
    (dicts for SequenceParallel); bound = k x the fp32-vs-fp64 error of the unsharded model
    (transformers' linear ops compute in fp32 whatever the input dtype)."""
    from ds_seqpar import SequenceParallel
    from ds_seqpar.config import ConfigError
    from ds_seqpar.hf import apply_sequence_parallel
    cfg = hybrid_config(model_type)
    state = build(cfg, torch.float32).state_dict()
    ids, labels = batch(cfg.vocab_size, seq=seq_of(model_type))
    ref = unsharded(cfg, state, ids, labels, torch.float64)
    plain = unsharded(cfg, state, ids, labels, torch.float32)
    out = []
    for setting in settings:
        sp = SequenceParallel(setting)
        model = build(cfg, torch.float32, state)
        if checkpointing:
            model.gradient_checkpointing_enable()
        try:
            apply_sequence_parallel(model, sp)
            res = model(**sp.shard_batch({"input_ids": ids, "labels": labels}))
            res.loss.backward()
        except ConfigError as err:                 # refused: the same message on every rank, before any collective
            out.append((setting, None, str(err)))
            continue
        out.append((setting,) + _worst_ratio(sp, model, res, ref, plain, (model_type, setting), rows))
    return out


def _per_document(cfg, state, ids, bounds, dtype):
    """The oracle for packed rows: each document run alone through the unsharded model; the loss is
    the mean next-token cross entropy over every document's own pairs."""
    import torch.nn.functional as F
    model = build(cfg, dtype, state)
    logits, total, count = [], 0.0, 0
    for a, b in zip(bounds[:-1], bounds[1:]):
        doc = ids[:, a:b]
        out = model(input_ids=doc, position_ids=torch.arange(b - a)[None]).logits
        logits.append(out)
        if b - a > 1:
            total = total + F.cross_entropy(out[0, :-1], doc[0, 1:], reduction="sum")
            count += b - a - 1
    loss = total / count
    loss.backward()
    return torch.cat(logits, 1).detach(), loss.detach(), {n: p.grad.detach().clone()
                                                          for n, p in model.named_parameters() if p.grad is not None}


def check_packed(model_type, settings, bounds):
    """Packed documents (global cu_seqlens ``bounds``, batch 1) under sequence parallelism against
    each document run alone: [(settings, worst error / bound, what)]."""
    from ds_seqpar import SequenceParallel
    from ds_seqpar.hf import apply_sequence_parallel
    cfg = hybrid_config(model_type)
    state = build(cfg, torch.float32).state_dict()
    ids, _ = batch(cfg.vocab_size, rows=1)
    ref = _per_document(cfg, state, ids, bounds, torch.float64)
    plain = _per_document(cfg, state, ids, bounds, torch.float32)
    out = []
    for setting in settings:
        sp = SequenceParallel(setting)
        model = apply_sequence_parallel(build(cfg, torch.float32, state), sp)
        res = model(**sp.shard_batch({"input_ids": ids, "labels": ids, "cu_seqlens": torch.tensor(bounds)}))
        res.loss.backward()
        out.append((setting,) + _worst_ratio(sp, model, res, ref, plain, (model_type, setting)))
    return out
