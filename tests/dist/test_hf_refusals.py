"""Refusals that involve a forward call: every rank raises, with the feature named, and no rank hangs
(the padding-mask flag goes through one all-reduce so a zero on one rank stops them all)."""
import torch

from ds_seqpar import SequenceParallel

from ..hf_models import tiny_model

SEQ = 32


def _message(fn):
    from ds_seqpar.hf import UnsupportedModelError
    try:
        fn()
    except UnsupportedModelError as err:
        return str(err)
    return "no error"


def _applied(family, sp, **overrides):
    from ds_seqpar.hf import apply_sequence_parallel
    return apply_sequence_parallel(tiny_model(family, **overrides), sp)


def refusal_messages():
    """Every scenario on every rank; returns {scenario: message}."""
    from ds_seqpar import comm
    from transformers.models.llama.modeling_llama import LlamaAttention, eager_attention_forward
    sp = SequenceParallel({"strategy": "zigzag", "size": 4})
    ids = torch.randint(0, 96, (1, SEQ), generator=torch.Generator().manual_seed(0))
    batch = sp.shard_batch({"input_ids": ids, "labels": ids})
    out = {}
    # a zero on the last rank only (zigzag: the middle of the sequence): all four must refuse, none may
    # wait for the others
    mask = torch.ones_like(batch["input_ids"])
    if comm.global_rank() == 3:
        mask[0, -1] = 0
    llama = _applied("llama", sp)
    out["mask"] = _message(lambda: llama(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                         attention_mask=mask))
    out["ones mask"] = _message(lambda: llama(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                              attention_mask=torch.ones_like(mask)))
    out["no position_ids"] = _message(lambda: llama(input_ids=batch["input_ids"]))
    out["3-D positions"] = _message(lambda: llama(input_ids=batch["input_ids"],
                                                  position_ids=batch["position_ids"][None].expand(3, -1, -1)))
    out["twice"] = _message(lambda: _applied_twice(llama, sp))
    from transformers import DynamicCache
    out["cache"] = _message(lambda: llama(**batch, past_key_values=DynamicCache(config=llama.config)))
    ulysses = SequenceParallel({"strategy": "ulysses", "size": 4})
    out["heads"] = _message(lambda: _applied("llama", ulysses, hidden_size=48, num_attention_heads=6))
    out["packed rows, batch 2"] = _message(lambda: llama(input_ids=batch["input_ids"].expand(2, -1),
                                                          position_ids=(batch["position_ids"] % 5).expand(2, -1)))
    dropout = _applied("llama", sp, attention_dropout=0.1)
    out["dropout"] = _message(lambda: dropout(**batch))
    # an attention layer that bypasses the registry (as legacy models do): caught after the forward
    bypass = tiny_model("llama")
    layer = bypass.model.layers[1]
    layer.self_attn = _bypassing(LlamaAttention, eager_attention_forward)(bypass.config, 1)
    from ds_seqpar.hf import apply_sequence_parallel
    apply_sequence_parallel(bypass, sp)
    out["bypass"] = _message(lambda: bypass(**batch))
    # a model computing its loss without model.loss_function (it would shift labels again)
    own_loss = tiny_model("llama")
    own_loss.__class__ = _own_loss_class(type(own_loss))
    apply_sequence_parallel(own_loss, sp)
    out["own loss"] = _message(lambda: own_loss(**batch))
    # per-token inputs that are not this rank's tokens alike
    embeds = llama.get_input_embeddings()(batch["input_ids"]).detach()
    out["ids and embeds"] = _message(lambda: llama(input_ids=batch["input_ids"], inputs_embeds=embeds,
                                                   position_ids=batch["position_ids"]))
    out["embeds length"] = _message(lambda: llama(inputs_embeds=embeds[:, 1:], position_ids=batch["position_ids"]))
    out["embeds"] = _message(lambda: llama(inputs_embeds=embeds, position_ids=batch["position_ids"]))
    # generate: refused options by name before any forward (test_generate.py has the rest); after
    # remove_sequence_parallel the model's own again
    prompt = batch["input_ids"][:, :5]
    out["generate"] = _message(lambda: llama.generate(input_ids=prompt, max_new_tokens=2, num_beams=2))
    from ds_seqpar.hf import remove_sequence_parallel
    remove_sequence_parallel(own_loss)
    own_loss.__class__ = type(llama)
    out["generate after remove"] = _message(
        lambda: own_loss.generate(input_ids=prompt, max_new_tokens=2, do_sample=False, pad_token_id=0))
    # resizing the embeddings after apply: the vocabulary is not sharded, the applied model runs on
    out["resize then forward"] = _message(
        lambda: (llama.resize_token_embeddings(llama.config.vocab_size + 8), llama(**batch)))
    return out


def _own_loss_class(base):
    class OwnLossForCausalLM(base):
        def forward(self, input_ids=None, position_ids=None, labels=None, **kwargs):
            out = super().forward(input_ids=input_ids, position_ids=position_ids, **kwargs)
            out.loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
            return out
    return OwnLossForCausalLM


def _applied_twice(model, sp):
    from ds_seqpar.hf import apply_sequence_parallel
    apply_sequence_parallel(model, sp)


def _bypassing(base, eager):
    class BypassAttention(base):
        """Calls its own eager attention instead of the configured implementation."""
        def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kw):
            shape = (*hidden_states.shape[:-1], -1, self.head_dim)
            q, k, v = (p(hidden_states).view(shape).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
            out, w = eager(self, q, k, v, None, scaling=self.scaling)
            return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), w
    return BypassAttention


EXPECTED = {
    "mask": "attention_mask with left or inner zeros",
    "ones mask": "no error",
    "no position_ids": "position_ids are required",
    "3-D positions": "multimodal 3-D position ids",
    "twice": "already has sequence parallelism applied",
    "cache": "past_key_values (cached attention) cannot be exact",
    "heads": "LlamaConfig num_attention_heads=6, num_key_value_heads=2: ",
    "packed rows, batch 2": "packed documents need batch size 1",
    "dropout": "attention dropout 0.1 in training",
    "bypass": "did not call the sequence-parallel attention (first: model.layers.1.self_attn (BypassAttention))",
    "own loss": "OwnLossForCausalLM computed its loss without model.loss_function",
    "generate": "LlamaForCausalLM.generate with num_beams=2 under sequence parallelism",
    "generate after remove": "no error",
    "ids and embeds": "got both input_ids and inputs_embeds",
    "embeds length": "'s inputs_embeds has",
    "embeds": "no error",
    "resize then forward": "no error",
}


def test_refusals_raise_on_every_rank_with_the_feature_named(pool):
    results = pool.run(refusal_messages)
    for scenario, expected in EXPECTED.items():
        messages = [r[scenario] for r in results]
        assert len(set(messages)) == 1, f"{scenario}: ranks disagree: {messages}"
        assert expected in messages[0], f"{scenario}: {messages[0]!r} does not name {expected!r}"
