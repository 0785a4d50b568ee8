"""The Hugging Face integration's refusals and pieces that need no processes: config and module
checks, per-call checks of the attention function, MLA head padding, model loading, --model options."""
import glob
import json
import os
import re

import pytest
import torch
import torch.nn.functional as F

from ds_seqpar.hf import UnsupportedModelError
from ds_seqpar.hf.attention import check_call, match_head_dims
from ds_seqpar.hf.checks import check_config, check_modules, sliding_window_of

from ..hf_models import save_tiny, tiny_config, tiny_model

ROOT = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)


def _config(name, **kw):
    import transformers as T
    return getattr(T, name)(**kw)


REFUSED = [
    ("DeepseekV4Config", {}, {}, "compressed attention (layer_types[0]='heavily_compressed_attention'"),
    ("Qwen3NextConfig", {}, {}, "token mixing outside attention (layer_types[0]='linear_attention'"),
    ("JambaConfig", {}, {}, "token mixing outside attention (layer_types[0]='linear_attention'"),
    ("MambaConfig", {}, {}, "token mixing outside attention"),
    ("Glm5NextTextConfig", {}, {}, "'linear_attention': a linear-attention, SSM or convolution layer of a family no "
                                   "hybrid adapter of ds_seqpar wraps)"),
    ("T5Config", {}, {}, "cross attention"),
    ("Qwen2VLConfig", {}, {}, "multimodal model (sub-configs ['vision_config']"),
    ("FalconConfig", {}, {}, "attention that ignores transformers' AttentionInterface"),
    ("GPTJConfig", {}, {}, "attention that ignores transformers' AttentionInterface"),
    ("BloomConfig", {}, {}, "attention that ignores transformers' AttentionInterface"),
    ("CodeGenConfig", {}, {}, "attention that ignores transformers' AttentionInterface"),
    ("MptConfig", {}, {}, "attention that ignores transformers' AttentionInterface"),
    ("LlamaConfig", {"attention_dropout": 0.1}, {"training": True}, "attention dropout 0.1 in training"),
    ("InklingTextConfig", {}, {}, "Inkling's attention (an additive relative-position bias"),
    ("Inkling2TextConfig", {}, {}, "Inkling's attention (an additive relative-position bias"),
    ("InstructBlipVideoConfig", {}, {"vision_ok": True}, "InstructBLIP-Video's Q-Former reading the call's position_ids"),
    ("Kosmos2Config", {}, {"vision_ok": True}, "Kosmos-2's image-to-text resampler"),
]


@pytest.mark.parametrize("name,kw,call,expected", REFUSED, ids=[f"{r[0]}-{r[3][:20]}" for r in REFUSED])
def test_config_features_are_refused_by_name(name, kw, call, expected):
    with pytest.raises(UnsupportedModelError, match="cannot be exact under sequence parallelism") as err:
        check_config(_config(name, **kw), **call)
    assert expected in str(err.value), str(err.value)


ACCEPTED = [
    ("LlamaConfig", {}, {"training": True}),
    ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}, {"training": True}),
    ("GraniteConfig", {}, {"training": True}),
    ("GemmaConfig", {}, {"training": True}),
    ("MistralConfig", {"sliding_window": 16}, {}),                          # windows: sp.attention(window=)
    ("Gemma2Config", {}, {"training": True}),                               # softcap: sp.attention(softcap=)
    ("Llama4TextConfig", {"attn_temperature_tuning": False}, {}),          # chunked layers: chunks as documents
    ("Llama4TextConfig", {}, {"training": True}),                           # temperature tuning: global positions
    ("DeepseekV32Config", {}, {"training": True}),                          # indexed attention: hf/indexed.py
    ("LlamaConfig", {"attention_dropout": 0.1}, {"training": False}),        # dropout is off in eval
    ("DeepseekV3Config", {}, {"training": True}),                            # MLA: padded, exact
    ("Gemma3TextConfig", {}, {}),
    ("UnlimitedOcrTextConfig", {}, {"training": True}),                   # reference windows: causal in training
]


@pytest.mark.parametrize("name,kw,call", ACCEPTED, ids=[a[0] for a in ACCEPTED])
def test_supported_configs_pass(name, kw, call):
    check_config(_config(name, **kw), **call)


def test_sliding_window_is_the_one_in_use():
    assert sliding_window_of(_config("Qwen2Config", sliding_window=4096)) is None      # use_sliding_window False
    assert sliding_window_of(_config("MistralConfig", sliding_window=100)) == 100
    assert sliding_window_of(_config("LlamaConfig")) is None


def test_module_features_are_refused_with_the_layer_named():
    import transformers as T
    oss = T.AutoModelForCausalLM.from_config(T.GptOssConfig(
        hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_local_experts=2, num_experts_per_tok=1, vocab_size=32, sliding_window=8,
        layer_types=["full_attention"]))
    assert [n for n, _ in check_modules(oss)] == ["model.layers.0.self_attn"]     # sinks: sp.attention(sinks=)
    conv = tiny_model("llama")
    conv.model.layers[1].mlp.mixer = torch.nn.Conv1d(4, 4, 3)
    with pytest.raises(UnsupportedModelError, match=r"token mixing outside attention \(Conv1d\) in "
                                                    r"model.layers.1.mlp.mixer"):
        check_modules(conv)
    names = [n for n, _ in check_modules(tiny_model("llama"))]
    assert names == ["model.layers.0.self_attn", "model.layers.1.self_attn"], names


def test_legacy_models_are_refused_and_left_untouched():
    import transformers as T
    from ds_seqpar.hf import apply_sequence_parallel
    falcon = T.AutoModelForCausalLM.from_config(T.FalconConfig(hidden_size=32, num_attention_heads=4,
                                                               num_hidden_layers=1, vocab_size=32))
    before = falcon.config._attn_implementation
    with pytest.raises(UnsupportedModelError, match="AttentionInterface in FalconConfig"):
        apply_sequence_parallel(falcon, sp=None)         # refused before the sp is even looked at
    assert falcon.config._attn_implementation == before


Q = torch.zeros(1, 4, 8, 16)       # [b, h, s, d]
KV = torch.zeros(1, 2, 8, 16)
CALLS = [
    (dict(key=torch.zeros(1, 2, 12, 16)), "cached or cross attention (key length 12 != query length 8)"),
    (dict(attention_mask=torch.ones(1, 1, 8, 8)), "an attention mask (shape (1, 1, 8, 8))"),
    (dict(dropout=0.1), "attention dropout 0.1 in training"),
    (dict(kwargs={"output_attentions": True}), "output_attentions=True"),
    (dict(causal=False), "non-causal attention without the real sequence length"),
]


@pytest.mark.parametrize("change,expected", CALLS, ids=[c[1][:24] for c in CALLS])
def test_attention_call_refusals_name_feature_and_layer(change, expected):
    args = dict(key=KV, attention_mask=None, dropout=0.0, kwargs={}, causal=True, seq_len=None, **{})
    args.update(change)
    with pytest.raises(UnsupportedModelError, match="in model.layers.3.self_attn") as err:
        check_call("model.layers.3.self_attn", Q, args["key"], args["attention_mask"], args["dropout"],
                   args["kwargs"], 2, args["causal"], args["seq_len"])
    assert expected in str(err.value), str(err.value)
    # windows, softcap and sinks go to sp.attention; non-causal with its length is fine
    check_call("l", Q, KV, None, 0.0, {"sliding_window": 3, "softcap": 5.0, "s_aux": torch.zeros(4)}, 2, True, None)
    check_call("l", Q, KV, None, 0.0, {}, 2, False, 16)


@pytest.mark.parametrize("d,dv", [(24, 8), (8, 24), (16, 16)])
def test_head_dim_padding_is_exact(d, dv):
    """MLA: zero-padding the smaller head dim, with the scale of the real qk dim, changes nothing."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 6, 3, d, generator=g, dtype=torch.float64), torch.randn(2, 6, 3, d, generator=g,
                                                                                 dtype=torch.float64)
    v = torch.randn(2, 6, 3, dv, generator=g, dtype=torch.float64)
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                          scale=d ** -0.5).transpose(1, 2)
    qp, kp, vp, keep = match_head_dims(q, k, v)
    assert qp.shape[-1] == kp.shape[-1] == vp.shape[-1] == max(d, dv) and keep == dv
    got = F.scaled_dot_product_attention(qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2), is_causal=True,
                                         scale=d ** -0.5).transpose(1, 2)[..., :keep]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_shipped_model_configs_load_small_gqa_and_supported():
    from ds_seqpar.hf.linear.families import LINEAR_LAYER_TYPES
    from ds_seqpar.hf.model_io import load_config
    paths = sorted(glob.glob(os.path.join(ROOT, "configs", "models", "*.json")))
    kinds = {}
    for path in paths:
        cfg = load_config(path)
        kinds[cfg.model_type] = cfg.vocab_size
        assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (256, 4, 8), path
        assert 2 <= cfg.num_key_value_heads <= 4, f"{path}: GQA with 2-4 k/v heads"
        hybrid = any(t in LINEAR_LAYER_TYPES for t in getattr(cfg, "layer_types", None) or ())
        check_config(cfg, training=True, linear_ok=hybrid)
    assert set(kinds) == {"llama", "qwen2", "qwen3_5_text", "bamba"} and 32000 in kinds.values(), kinds


def test_model_paths_load_weights_or_config(tmp_path):
    from ds_seqpar.hf.model_io import ModelLoadError, has_weights, load_causal_lm, load_config
    with_weights = save_tiny(tmp_path / "w", "qwen2", seed=3)
    config_only = save_tiny(tmp_path / "c", "qwen2", weights=False)
    assert has_weights(with_weights) and not has_weights(config_only)
    model, loaded = load_causal_lm(with_weights)
    want = tiny_model("qwen2", seed=3).state_dict()
    assert loaded and all(torch.equal(model.state_dict()[k], v) for k, v in want.items())
    model, loaded = load_causal_lm(config_only)
    assert not loaded and model.config._attn_implementation == "sdpa"
    json_path = tmp_path / "m.json"
    json_path.write_text(json.dumps(tiny_config("llama").to_dict()))
    assert load_config(str(json_path)).model_type == "llama"
    json_path.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ModelLoadError, match="no 'model_type'"):
        load_config(str(json_path))
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_config(str(tmp_path / "missing"))


@pytest.mark.parametrize("strategy,expected", [
    ("lasp", "--model 'm' with sequence_parallel.strategy='lasp'"),
])
def test_model_option_refusals_name_the_option(strategy, expected):
    from ds_seqpar.train.args import TrainConfigError, resolve_args
    from ds_seqpar.train.hf_model import check_options
    with pytest.raises(TrainConfigError) as err:
        check_options(resolve_args({"model": "m"}), strategy)
    assert expected in str(err.value)


class _RecordingSP:
    """Stands in for SequenceParallel (size 1): records what the registered function passes."""
    size = 1

    def __init__(self):
        self.calls = []

    def attention(self, q, k, v, causal=True, softmax_scale=None, seq_len=None, cu_seqlens=None, window=None,
                  softcap=None, sinks=None, blocks=None):
        assert blocks is None, "a text model's layer passed bidirectional blocks"
        self.calls.append(dict(shapes=(q.shape, k.shape, v.shape), causal=causal, scale=softmax_scale,
                               cu_seqlens=cu_seqlens, window=window, softcap=softcap, sinks=sinks))
        return torch.zeros(q.shape[:-1] + (q.shape[-1],))


def _function(sp):
    from ds_seqpar.hf.apply import SequenceParallelState
    from ds_seqpar.hf.attention import make_attention_function
    return make_attention_function(SequenceParallelState(sp, "k", [], "sdpa", None))


def test_attention_function_layouts_scale_and_packed_pass_through():
    sp = _RecordingSP()
    fn = _function(sp)
    module = torch.nn.Module()
    q, k, v = torch.zeros(2, 4, 8, 24), torch.zeros(2, 2, 8, 24), torch.zeros(2, 2, 8, 8)   # [b, h, s, d], MLA v
    out, weights = fn(module, q, k, v, None, dropout=0.0, scaling=0.3)
    assert out.shape == (2, 8, 4, 8) and weights is None            # [b, s, h, dv]
    call = sp.calls[-1]
    assert call["shapes"] == ((2, 8, 4, 24), (2, 8, 2, 24), (2, 8, 2, 24)) and call["scale"] == 0.3
    assert call["causal"] is True and call["cu_seqlens"] is None
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    fn(module, q, k, v, None, scaling=None, cu_seqlens=cu)
    assert sp.calls[-1]["cu_seqlens"] is cu and sp.calls[-1]["scale"] == 24 ** -0.5      # scale of the real d
    fn(module, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=5, max_length_k=5)
    assert sp.calls[-1]["cu_seqlens"] is cu
    module.is_causal = False
    fn(module, q, k, v, None, sp_seq_len=8)
    assert sp.calls[-1]["causal"] is False
    # the layer's window, softcap and sinks go through; a window covering the sequence is dropped
    sinks = torch.zeros(4)
    module.is_causal = True
    fn(module, q, k, v, None, sliding_window=3, softcap=30.0, s_aux=sinks)
    assert (sp.calls[-1]["window"], sp.calls[-1]["softcap"], sp.calls[-1]["sinks"]) == (3, 30.0, sinks)
    fn(module, q, k, v, None, sliding_window=8)
    assert sp.calls[-1]["window"] is None
    # Llama 4 chunked layers: chunks of attention_chunk_size become documents, with packed ones
    from types import SimpleNamespace
    module.config = SimpleNamespace(layer_types=["full_attention", "chunked_attention"], attention_chunk_size=3)
    module.layer_idx = 1
    fn(module, q, k, v, None, cu_seqlens=torch.tensor([0, 5, 8]))
    assert sp.calls[-1]["cu_seqlens"] == [0, 3, 5, 6, 8]
    module.layer_idx = 0
    fn(module, q, k, v, None)
    assert sp.calls[-1]["cu_seqlens"] is None
    stale = _function(None)
    with pytest.raises(RuntimeError, match="after remove_sequence_parallel"):
        stale(module, q, k, v, None)


def test_routed_loss_does_not_shift_again_and_takes_the_trainers_token_count():
    from ds_seqpar.hf.apply import SequenceParallelState
    from ds_seqpar.hf.loss import make_loss_function

    class OneRank:
        def loss(self, logits, labels, ignore_index=-100):
            return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=ignore_index)

    state = SequenceParallelState(OneRank(), "k", [], "sdpa", None)
    fn = make_loss_function(state)
    logits, labels = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten())          # labels taken as already shifted
    torch.testing.assert_close(fn(logits, labels, 7), want)                 # positional (Gemma2, Jamba)
    torch.testing.assert_close(fn(logits=logits, labels=None, vocab_size=7, shift_labels=labels), want)
    assert state.loss_routed
    # the Trainer's count of the accumulation window: this rank's local sum over it (hf/trainer.py)
    labels[0, 0] = -100
    local_sum = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    torch.testing.assert_close(fn(logits=logits, labels=None, vocab_size=7, shift_labels=labels,
                                  num_items_in_batch=torch.tensor(10)), local_sum / 10)


def test_releases_outside_the_tested_range_are_refused_by_name(monkeypatch):
    """An installed transformers / TRL / accelerate outside hf/versions.TESTED is refused with the package, the
    version and the tested range (and how to try it anyway); the installed, tested ones pass."""
    from ds_seqpar.hf import versions
    versions.check_tested(("transformers", "trl", "accelerate"), env={})
    for version in ("5.26.0", "5.26.0.dev0", "5.22.3", "6.0.0"):
        monkeypatch.setattr(versions, "installed", lambda package, v=version: v)
        with pytest.raises(UnsupportedModelError, match=rf"transformers {re.escape(version)} is outside the range "
                                                        r"ds_seqpar is tested with \(transformers>=5.23.0,<5.26.0\).*"
                                                        r"DS_SEQPAR_UNTESTED_OK=1"):
            versions.check_tested(("transformers",), env={})
        versions.check_tested(("transformers",), env={"DS_SEQPAR_UNTESTED_OK": "1"})
    for version in ("5.24.1", "5.25.0"):
        monkeypatch.setattr(versions, "installed", lambda package, v=version: v)
        versions.check_tested(("transformers",), env={})



def test_a_release_that_breaks_a_model_by_itself_is_named():
    """hf/versions.UPSTREAM_BREAKS: Llama 4's multimodal class under transformers 5.24 (its own forward fails),
    not under 5.23; other classes never."""
    from ds_seqpar.hf.versions import upstream_break
    assert "transformers 5.24.0 breaks Llama4ForConditionalGeneration" in upstream_break(
        "Llama4ForConditionalGeneration", "5.24.0")
    assert upstream_break("Llama4ForConditionalGeneration", "5.23.0") is None
    assert upstream_break("Llama4ForCausalLM", "5.24.0") is None

def test_a_seam_binds_the_arguments_of_an_op_a_module_wraps():
    """transformers 5.25 wraps each op of the hybrids' modeling files in an nn.Module (so that a hub kernel can
    replace it) whose forward is the op: the seam binds positional arguments by the forward's names (the
    module's own signature is (*args, **kwargs): the conv seam then found no hidden_states and failed)."""
    from ds_seqpar.hf.linear.seams import _parameters

    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        return hidden_states

    class Func(torch.nn.Module):          # what 5.25's use_kernel_func_from_hub makes of the function
        forward = staticmethod(causal_conv1d_fn)
    want = (("hidden_states", "weight", "bias", "activation"), {"bias": None, "activation": None})
    assert _parameters(causal_conv1d_fn) == want
    assert _parameters(Func()) == want


def test_seams_skip_a_fused_path_the_release_does_not_have(monkeypatch):
    """5.25's Falcon-Mamba has no fused mamba_inner_fn path (an optional op: the layer's conv and scan seams
    still see every token); a missing required op still stops apply by name."""
    import sys
    import types

    from ds_seqpar.hf.linear.seams import install_seams
    modeling = types.ModuleType("ds_seqpar_test_modeling_falcon_mamba")
    modeling.causal_conv1d_fn = lambda hidden_states, weight, bias=None, activation=None: hidden_states
    modeling.mamba_selective_scan = lambda u, delta, A, B, C, D=None: u
    monkeypatch.setitem(sys.modules, modeling.__name__, modeling)
    layer = type("FalconMambaMixer", (torch.nn.Module,), {"__module__": modeling.__name__})()
    install_seams([("model.layers.0.mixer", layer)])
    assert hasattr(modeling.causal_conv1d_fn, "_ds_seqpar_original")
    assert hasattr(modeling.mamba_selective_scan, "_ds_seqpar_original") and not hasattr(modeling, "mamba_inner_fn")
    del modeling.mamba_selective_scan
    with pytest.raises(UnsupportedModelError, match="FalconMambaMixer's modeling file has no mamba_selective_scan"):
        install_seams([("model.layers.0.mixer", layer)])


def test_setup_cfg_bounds_are_the_tested_ranges():
    """setup.cfg's extras bound each Hugging Face package by hf/versions.TESTED (one range, said twice)."""
    import configparser
    import pathlib

    from ds_seqpar.hf.versions import TESTED, _key

    def release(version):                  # setup.cfg's "5.23" is release 5.23.0
        return _key(version + ".0.0")

    cfg = configparser.ConfigParser()
    cfg.read(pathlib.Path(__file__).parents[2] / "setup.cfg")
    for extra in ("test", "hf"):
        lines = [line.strip() for line in cfg["options.extras_require"][extra].splitlines() if line.strip()]
        for package, (low, high) in TESTED.items():
            spec = next((line for line in lines if re.match(rf"{package}\b", line)), None)
            if spec is None:
                continue
            found = dict(re.findall(r"(>=|<)([\d.]+)", spec))
            assert (release(found[">="]), release(found["<"])) == (_key(low), _key(high)), (extra, spec, low, high)
