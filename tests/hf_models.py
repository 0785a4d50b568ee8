"""Tiny random-init transformers models for the Hugging Face integration tests (no hub: built from
configs, saved locally when a test needs a model directory)."""
import torch
import torch.nn.functional as F

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=96, max_position_embeddings=256, attention_dropout=0.0, use_cache=False)


def tiny_config(family: str, **overrides):
    import transformers as T
    if family == "llama":
        return T.LlamaConfig(**dict(COMMON, **overrides))
    if family == "qwen2":          # q/k/v biases
        return T.Qwen2Config(**dict(COMMON, **overrides))
    if family == "granite":        # attention scale = attention_multiplier, not head_dim ** -0.5
        return T.GraniteConfig(**dict(COMMON, attention_multiplier=0.3, embedding_multiplier=2.0,
                                      residual_multiplier=0.5, logits_scaling=1.5, **overrides))
    if family == "deepseek_v3":    # MLA: value head 8 != query/key head 16 + 8
        return T.DeepseekV3Config(**dict(COMMON, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
                                         qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=8,
                                         first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, n_group=1, topk_group=1, **overrides))
    if family == "deepseek_v32":   # DeepSeek sparse attention: MLA + an indexer keeping 8 of 32 keys
        return T.DeepseekV32Config(**dict(dict(COMMON, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
                                               qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=8,
                                               index_n_heads=4, index_head_dim=16, index_topk=8,
                                               first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
                                               moe_intermediate_size=32, n_group=1, topk_group=1), **overrides))
    raise KeyError(family)


def tiny_model(family: str, dtype=torch.float32, state_dict=None, seed: int = 0, **overrides):
    """Random init from ``seed`` (or ``state_dict``), sdpa attention, training mode."""
    import transformers as T
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(tiny_config(family, **overrides), attn_implementation="sdpa")
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model.to(dtype).train()


def textbook_loss(logits_bnv, labels_bn):
    """Next-token cross entropy over the whole sequence, in the logits' own dtype (HF's loss casts to
    fp32, which would spoil a float64 reference)."""
    return F.cross_entropy(logits_bnv[:, :-1].reshape(-1, logits_bnv.shape[-1]), labels_bn[:, 1:].reshape(-1),
                           ignore_index=-100)


def unsharded_run(family, state_dict, ids_bn, labels_bn, dtype):
    """(logits, loss, {param name: grad}) of the plain model on the whole sequence in ``dtype``."""
    model = tiny_model(family, dtype, state_dict)
    pos = torch.arange(ids_bn.shape[1]).expand_as(ids_bn)
    logits = model(input_ids=ids_bn, position_ids=pos).logits
    loss = textbook_loss(logits, labels_bn)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), loss.detach(), grads


def save_tiny(path, family: str = "llama", seed: int = 0, weights: bool = True, **overrides) -> str:
    """A local model directory: config.json, plus model.safetensors when ``weights``."""
    model = tiny_model(family, seed=seed, **overrides)
    if weights:
        model.save_pretrained(path)
    else:
        model.config.save_pretrained(path)
    return str(path)
