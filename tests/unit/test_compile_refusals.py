"""Bad input under torch.compile: a mode that cannot be compiled yet fails at the first compiled call with
a message naming the feature and what works; never a silent eager fallback inside fullgraph=True."""
import pytest
import torch
from torch import nn

from ds_seqpar.hf.hooks import linear_documents
from ds_seqpar.hf.linear.families import LIGHTNING
from ds_seqpar.hf.linear.seams import count, layer_hooks


class _Mixers:
    decoding = False             # not inside generate's decode step (hf/linear/mixers.py)

    def where(self, module):
        return "model.layers.0.self_attn (MiniMaxLightningAttention)"


class MiniMaxLightningAttention(nn.Linear):
    """Stands in for transformers' class of that name (the hooks look layers up by class name); counts
    its op call as the replaced forward does (hf/linear/lightning.py)."""

    def forward(self, x):
        count(LIGHTNING)
        return super().forward(x)


def test_lightning_attention_hooks_compile_fullgraph():
    """No refusal: the layer's exchange runs in the linear layers' opaque op (tests/dist/test_compile_hybrids.py
    compiles an applied MiniMax against eager)."""
    layer = MiniMaxLightningAttention(4, 4)
    handles = layer_hooks(_Mixers(), layer)
    try:
        x = torch.randn(2, 4)
        assert torch.equal(torch.compile(layer, backend="eager", fullgraph=True)(x), layer(x))
    finally:
        for h in handles:
            h.remove()


def test_hybrids_packed_documents_compile_as_an_input_and_refuse_several_rows_by_name():
    """Under compile the documents stay the model's tensor (an input of the linear layers' op, cut at on
    the host in its body); packed rows of batch > 1 are refused by name, compiled as eager."""
    layer = nn.Linear(4, 4)

    def documents(cu_seqlens, position_ids):
        return linear_documents(cu_seqlens, None, position_ids, layer) * 2

    bounds = torch.tensor([0, 3, 8])
    assert torch.equal(torch.compile(documents, backend="eager", fullgraph=True)(bounds, torch.zeros(1, 8)), bounds * 2)
    assert linear_documents(bounds, None, torch.zeros(1, 8), layer) == [0, 3, 8]
    for run in (documents, torch.compile(documents, backend="eager", fullgraph=True)):
        with pytest.raises(Exception) as err:
            run(bounds, torch.zeros(2, 8))
        assert "packed documents with 2 rows" in str(err.value) and "batch size 1" in str(err.value)
