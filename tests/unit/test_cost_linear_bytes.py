"""The bytes of one hybrid linear layer, per family, lasp_comm and linear_strategy: the cost model's
(cost/bytes.linear_layer_bytes on the shape its one reader takes from the family's config, what
``ds-seqpar bench hybrid`` holds the measured bytes to) against the closed forms written out per family
from the config here, tensor by tensor (the oracle; tests/dist/test_hf_hybrids.py holds the same forms
to the bytes real ranks send)."""
import types

import pytest

from ds_seqpar.bench.hybrid import FAMILIES, SP_CASES, family_cases, family_config, layer_bytes
from ds_seqpar.sharding.layouts import make_layout
from ds_seqpar.strategies.closed_form import conv_halo_bytes, linear_state_bytes, linear_ulysses_bytes
from ds_seqpar.strategies.lasp_chain import fragments


def closed_forms(fam, case, p, seq, hidden):
    """Bytes per rank from the family's config: the conv halo, then the states (lasp) or the all-to-all of
    the op's inputs and output (ulysses), on the ring strategy's contiguous runs."""
    c, t = family_config(fam, hidden), seq // p
    frags = fragments(make_layout("contiguous", p), seq)
    state = halo = None             # (heads, dk, dv) of the state and its transition; (channels, width) of the conv
    if fam == "gdn":
        hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
        dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
        state, kind, elems = (hv, dk, dv), "matrix", [t * hk * dk] * 2 + [t * hv * dv] * 2 + [t * hv] * 2
        halo = (2 * hk * dk + hv * dv, c.linear_conv_kernel_dim - 1)
    elif fam == "kda":
        h, d = c.linear_num_heads, c.linear_head_dim
        state, kind, elems = (h, d, d), "matrix", [t * h * d] * 5 + [t * h]          # q, k, v, g, out; beta
        halo = (3 * h * d, c.linear_conv_kernel_dim - 1)
    elif fam == "ssd":
        h, pd, n, g = c.mamba_n_heads, c.mamba_d_head, c.mamba_d_state, c.mamba_n_groups
        state, kind, elems = (h, pd, n), "scalar", [t * h * pd] * 2 + [t * h] + [t * g * n] * 2   # x, out; dt; B, C
        halo = (int(c.mamba_expand * c.hidden_size) + 2 * g * n, c.mamba_d_conv - 1)
    elif fam == "lightning":
        h, d = c.num_attention_heads, c.head_dim
        state, kind, elems = (h, d, d), "fixed", [t * h * d] * 4
    else:
        halo = (c.hidden_size, c.conv_L_cache - 1)
    out = []
    for r in range(p):
        total = conv_halo_bytes(frags, 1, halo[0], halo[1], 4)["conv_halo"] if halo else 0
        if state and SP_CASES[case]["linear_strategy"] == "ulysses":
            total += linear_ulysses_bytes(p, elems, 4)["linear_all_to_all"]
        elif state:
            total += sum(linear_state_bytes(frags, r, 1, *state, SP_CASES[case]["lasp_comm"], kind).values())
        out.append(total)
    return out


@pytest.mark.parametrize("fam", sorted(FAMILIES))
@pytest.mark.parametrize("p,seq", [(2, 256), (4, 1024), (8, 512)])
def test_the_cost_models_linear_layer_bytes_are_the_families_closed_forms(fam, p, seq):
    args = types.SimpleNamespace(P=p, seq=seq, hidden=512)
    for case in (c for c in family_cases(fam) if c in SP_CASES):
        got, want = layer_bytes(fam, case, args), closed_forms(fam, case, p, seq, 512)
        assert got == want and all(b > 0 for b in want), (fam, case, got, want)
