"""Bad input under torch.compile: a mode that cannot be compiled yet fails at the first compiled call with
a message naming the feature and what works; never a silent eager fallback inside fullgraph=True."""
import pytest
import torch
from torch import nn

from ds_seqpar.hf.linear.seams import layer_hooks


class _Mixers:
    def where(self, module):
        return "model.layers.0.linear_attn (Qwen3NextGatedDeltaNet)"


def test_hybrid_linear_layer_refuses_fullgraph_compile_by_name():
    layer = nn.Linear(4, 4)
    handles = layer_hooks(_Mixers(), layer)
    try:
        x = torch.randn(2, 4)
        with pytest.raises(Exception) as err:
            torch.compile(layer, backend="eager", fullgraph=True)(x)
        text = str(err.value)
        for needed in ("model.layers.0.linear_attn", "cannot be compiled yet", "sp.attention", "fullgraph"):
            assert needed in text, f"{needed!r} missing from: {text}"
    finally:
        for h in handles:
            h.remove()
