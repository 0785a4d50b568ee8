"""Bad input under torch.compile: a mode that cannot be compiled yet fails at the first compiled call with
a message naming the feature and what works; never a silent eager fallback inside fullgraph=True."""
import pytest
import torch
from torch import nn

from ds_seqpar.hf.hooks import linear_documents
from ds_seqpar.hf.linear.seams import layer_hooks


class _Mixers:
    def where(self, module):
        return "model.layers.0.self_attn (MiniMaxLightningAttention)"


class MiniMaxLightningAttention(nn.Linear):
    """Stands in for transformers' class of that name (the hooks look layers up by class name)."""


def test_lightning_attention_refuses_fullgraph_compile_by_name():
    layer = MiniMaxLightningAttention(4, 4)
    handles = layer_hooks(_Mixers(), layer)
    try:
        x = torch.randn(2, 4)
        with pytest.raises(Exception) as err:
            torch.compile(layer, backend="eager", fullgraph=True)(x)
        text = str(err.value)
        for needed in ("model.layers.0.self_attn", "cannot be compiled yet", "sp.attention", "gated DeltaNet",
                       "fullgraph"):
            assert needed in text, f"{needed!r} missing from: {text}"
    finally:
        for h in handles:
            h.remove()


def test_hybrids_packed_documents_refuse_compile_by_name():
    """The linear layers cut their exchange at the documents on the host: refused at the first compiled call."""
    layer = nn.Linear(4, 4)

    def documents(cu_seqlens, position_ids):
        return linear_documents(cu_seqlens, None, position_ids, layer)

    with pytest.raises(Exception) as err:
        torch.compile(documents, backend="eager", fullgraph=True)(torch.tensor([0, 3, 8]), torch.zeros(1, 8))
    assert "packed documents (cu_seqlens)" in str(err.value) and "cannot be compiled yet" in str(err.value)
    assert linear_documents(torch.tensor([0, 3, 8]), None, torch.zeros(1, 8), layer) == [0, 3, 8]
