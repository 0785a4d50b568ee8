"""`ds-seqpar plan`'s cost model against the project's own oracles: the strategies' closed forms,
the measured-memory benchmark's FLOP count and its measured bytes per token (reports/memory_cpu.rows.json),
and the main job's config checks for the JSON it writes. Pure Python, no ranks."""
from __future__ import annotations

import json
import os

import pytest

from ds_seqpar.config import SequenceParallelConfig
from ds_seqpar.plan import hardware
from ds_seqpar.cost import flops, memory
from ds_seqpar.plan.main import main as plan_main
from ds_seqpar.cost.candidate import Candidate, Features
from ds_seqpar.cost.model_shape import ModelShape
from ds_seqpar.cost.bytes import comm_per_layer
from ds_seqpar.plan.search import NEAR_TIE, Cluster, longest_sequence, plan, predict
from ds_seqpar.strategies.closed_form import Shapes, closed_form_by_kind, transient_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA = os.path.join(ROOT, "configs", "models", "llama_small.json")
HYBRID = os.path.join(ROOT, "configs", "models", "qwen3_5_small.json")
MEMORY_REPORT = os.path.join(ROOT, "reports", "memory_cpu.rows.json")
SMALL = ModelShape("small", hidden=256, layers=8, heads=8, kv_heads=2, head_dim=32, intermediate=688, vocab=32000)


def _shape_of(m: dict, tied: bool) -> ModelShape:
    return ModelShape(m["model"], hidden=m["hidden"], layers=m["layers"], heads=m["heads"], kv_heads=m["kv_heads"],
                      head_dim=m["hidden"] // m["heads"], intermediate=m["intermediate"], vocab=m["vocab"], tied=tied)


# -- bytes: the closed forms ---------------------------------------------------------------------

@pytest.mark.parametrize("strategy,size,u", [("ulysses", 4, 4), ("ring", 4, 1), ("zigzag", 8, 1), ("striped", 2, 1),
                                             ("zigzag", 8, 2), ("ring", 16, 4)])
def test_comm_per_layer_is_the_closed_form(strategy, size, u):
    n, e = 1024, 2
    c = Candidate(strategy, size, u, 2, Features())
    got = comm_per_layer(c, SMALL, n, e)["attention"]
    want = closed_form_by_kind(strategy, size, Shapes(1, size * n, 8, 2, 32, e), 0, u)
    assert got == want, f"{strategy} P={size} U={u}: plan {got} != closed_form {want}"
    # and the bytes grow with the local length as the forms say (ring: linear in n)
    assert comm_per_layer(c, SMALL, 2 * n, e)["attention"] == {k: 2 * v for k, v in want.items()}


@pytest.mark.parametrize("strategy,size,u", [("ulysses", 4, 4), ("zigzag", 4, 1), ("ring", 8, 2)])
def test_comm_buffers_per_token_are_transient_bytes(strategy, size, u):
    n = 4096
    per_tok = memory.comm_per_token(strategy, size, u, SMALL, 2)
    want = transient_bytes(strategy, size, Shapes(1, size * n, 8, 2, 32, 2), u)
    assert per_tok["forward"] * n == want["forward"] and per_tok["backward"] * n == want["backward"]


# -- FLOPs: counted by hand ------------------------------------------------------------------------

def step_macs_per_token(meta, world: int, tokens_per_rank: int, features: bool) -> int:
    """Multiply-accumulates per token of one training step's matmuls, backward = 2 x forward. Plain: every
    matmul forward once, backward once; with the features the fused loss runs the LM head's forward again
    in its backward, a checkpointed layer its forward again, and its tiled MLP once more inside that
    recompute's backward. Causal attention over S = P x N costs hidden x S per token (q.k and p.v over
    S/2 keys on average). Elementwise work is not counted."""
    h, L = meta["hidden"], meta["layers"]
    kv_dim = h // meta["heads"] * meta["kv_heads"]
    head, proj, attn = h * meta["vocab"], h * (2 * h + 2 * kv_dim), h * world * tokens_per_rank
    mlp = 3 * h * meta["intermediate"]                # gate, up, down
    if not features:
        return 3 * (head + L * (proj + attn + mlp))
    return 4 * head + L * (4 * (proj + attn) + 5 * mlp)


@pytest.mark.parametrize("features", [False, True])
@pytest.mark.parametrize("world,n", [(1, 2048), (2, 8192), (4, 4096)])
def test_step_flops_match_the_memory_benchmark_count(features, world, n):
    meta = {"hidden": 256, "layers": 8, "heads": 8, "kv_heads": 2, "intermediate": 688, "vocab": 32000}
    ours = sum(flops.step_per_token(SMALL, world * n, features).values())
    assert ours == pytest.approx(2 * step_macs_per_token(meta, world, n, features), rel=1e-12)


def test_window_and_causal_work_ratios():
    assert flops.keys_per_query(1000, causal=True) == 500
    assert flops.keys_per_query(1000, causal=False) == 1000
    # causal window w: sum over queries of min(i + 1, w), by brute force
    s, w = 997, 64
    assert flops.keys_per_query(s, True, w) == pytest.approx(sum(min(i + 1, w) for i in range(s)) / s)


# -- memory: the measured step ----------------------------------------------------------------------

def _measured_variants():
    from ds_seqpar.bench.memory_rows import variants
    path = MEMORY_REPORT
    with open(path) as f:
        report = json.load(f)["facts"]          # the bench's record rides in its rows file's facts
    ms = [m for m in report["measurements"] if m.get("purpose") in (None, "scaling")]
    groups = {}
    for m in ms:
        groups.setdefault((m["model"], m["world"], m["features"]), []).append(m)
    usable = [m for g in groups.values() if len({x["tokens_per_rank"] for x in g}) >= 2 for m in g]
    if not usable:
        pytest.skip("reports/memory_cpu.rows.json holds no variant measured at two lengths (being re-measured?)")
    return usable, variants(dict(report, measurements=usable))


def test_bytes_per_token_agree_with_the_measured_step():
    """fp32, ZeRO-2, CPU (checkpoints stay in the same memory): the tensor count within 10% of every
    measured variant's bytes per token (15% for a variant measured only up to 4096 tokens per rank) (the plain step's phases within 5% each), and the count plus
    the strategy's comm buffers an upper bound within 5%."""
    ms, variants = _measured_variants()
    checked = []
    for key, v in variants.items():
        m = next(x for x in ms if (x["model"], x["world"], x["features"]) == key)
        shape = _shape_of(m, tied=m["model"] != "llama")
        f = Features(on=m["features"], cpu_checkpointing=False, tiled_loss_tokens=m["tiled_loss_tokens"],
                     tiled_mlp_tokens=m["tiled_mlp_tokens"])
        lines = memory.phase_lines(shape, m["strategy"], m["world"], m.get("ulysses_size", 1), m["world"], 2, "fp32", f,
                                   checkpoints_on_device=True)
        bare = max(memory.per_token(shape, 4, f, True).values())
        with_comm = max(line["b"] for line in lines.values())
        measured = v["bytes_per_token"]
        # a fit that stops at 4096 tokens per rank (P=4: 16K tokens a step) still carries the tiled
        # chunks' steps (1024-token MLP chunks, one checkpointed layer's transients): 15% there
        longest = max(r["tokens_per_rank"] for r in v["points"])
        tol = 0.10 if longest >= 8192 else 0.15
        assert abs(bare / measured - 1) <= tol, f"{key}: predicted {bare:.0f} B/token, measured {measured:.0f}"
        if not m["features"]:       # the plain step: every phase's slope within 5% (the head would hide the layers)
            ours = memory.per_token(shape, 4, f, True)
            for phase in ("forward", "loss_backward", "layers_backward"):
                got = v["lines"][phase]["b"]
                assert abs(ours[phase] / got - 1) <= 0.05, f"{key} {phase}: predicted {ours[phase]:.0f}, measured {got:.0f}"
        assert measured <= with_comm * 1.05, f"{key}: measured {measured:.0f} above the bound {with_comm:.0f}"
        checked.append(key)
    assert checked


def test_static_memory_follows_zero2_sharding():
    """What ZeRO-2 frees per rank from P=1 to P=2 (fp32 AdamW: gradients and moments, 12 Psi / 2)
    against the measured resident set (same model, same features, same length)."""
    ms, _ = _measured_variants()
    pairs = []
    for m1 in ms:
        for m2 in ms:
            if (m1["world"], m2["world"]) == (1, 2) and m1["model"] == m2["model"] == "llama" and \
                    m1["features"] == m2["features"] and m1["tokens_per_rank"] == m2["tokens_per_rank"]:
                pairs.append((m1, m2))
    if not pairs:
        pytest.skip("no llama P=1 / P=2 pair at one length in reports/memory_cpu.rows.json")
    for m1, m2 in pairs:
        shape = _shape_of(m1, tied=False)
        want = sum(memory.static_bytes(shape, 1, 2, "fp32").values()) - sum(memory.static_bytes(shape, 2, 2, "fp32").values())
        got = m1["resident_bytes"] - m2["resident_bytes"]
        assert abs(got / want - 1) <= 0.05, f"static P1 - P2: measured {got}, predicted {want}"


def test_max_tokens_is_the_benchmark_inverse():
    from ds_seqpar.cost.memory import max_tokens, peak as predict_peak
    lines = memory.phase_lines(SMALL, "zigzag", 2, 1, 2, 2, "bf16", Features(on=True), checkpoints_on_device=False)
    budget = 8e9
    n = memory.max_tokens(lines, budget)
    assert n == max_tokens(lines, budget)
    assert predict_peak(lines, n) <= budget < predict_peak(lines, n + 2)


# -- hardware profiles ----------------------------------------------------------------------------

def test_profiles_name_their_sources_and_bad_names_list_the_known():
    for name in ("h100", "h200", "b200", "a100"):
        gpu = hardware.load_gpu(name)
        assert gpu.sources and 0 < gpu.usable_bytes < gpu.peaks["memory_gb"] * 1e9
        assert gpu.intra.beta_bytes_s > gpu.inter.beta_bytes_s
    with pytest.raises(hardware.PlanError, match="h100"):
        hardware.load_gpu("h300")


def test_custom_profile(tmp_path):
    raw = json.load(open(os.path.join(os.path.dirname(hardware.__file__), "profiles", "h100.json")))
    raw["datasheet_peaks"]["memory_gb"] = 40
    path = tmp_path / "half.json"
    path.write_text(json.dumps(raw))
    assert hardware.load_gpu(str(path)).usable_bytes < hardware.load_gpu("h100").usable_bytes
    del raw["assumed"]["matmul_efficiency"]
    path.write_text(json.dumps(raw))
    with pytest.raises(hardware.PlanError, match="matmul_efficiency"):
        hardware.load_gpu(str(path))


# -- the search ------------------------------------------------------------------------------------

def test_ranking_and_rejections():
    cl = Cluster(16, 8, hardware.load_gpu("h100"), "bf16")
    ok, rejected = plan(SMALL, 1 << 20, cl, zero=2)
    # by tokens/s, up to the near-ties the ranking breaks toward simpler and roomier (test_plan_ranking.py)
    assert ok and ok[0].tokens_s >= (1 - NEAR_TIE) * max(p.tokens_s for p in ok)
    assert all(b.tokens_s * (1 - NEAR_TIE) <= a.tokens_s for a, b in zip(ok, ok[1:]))
    assert all(p.peak_bytes <= p.budget_bytes for p in ok)
    # Ulysses over more ranks than heads: refused with the main job's message
    uly16 = [p for p in rejected if p.candidate.strategy == "ulysses" and p.candidate.size == 16]
    assert uly16 and all("not divisible" in p.reason for p in uly16)
    # the same candidate over one node's NVLink vs across nodes: the all-to-all costs more across
    inside = predict(Candidate("ulysses", 8, 8, 2, Features(on=True)), SMALL, 1 << 20, cl)
    across = predict(Candidate("ulysses", 8, 8, 2, Features(on=True)), SMALL, 1 << 20, Cluster(16, 4, cl.gpu, "bf16"))
    assert across.comm_s["attention"] > inside.comm_s["attention"]


def test_longest_sequence_grows_with_gpus_and_features():
    gpu = hardware.load_gpu("h100")
    # one GPU per node: each GPU keeps its own host memory for the offloaded checkpoints
    one, eight = (longest_sequence(SMALL, Cluster(g, 1, gpu, "bf16"), zero=3) for g in (1, 8))
    # less than 8x: at P > 1 every token also needs the strategy's comm buffers (transient_bytes),
    # a quarter of this small model's per-token bytes
    assert 6 * one <= eight <= 8 * one
    c_on, c_off = (Candidate("zigzag", 8, 1, 3, Features(on=f)) for f in (True, False))
    cl = Cluster(8, 8, gpu, "bf16")
    assert predict(c_on, SMALL, 8, cl).max_seq > 8 * predict(c_off, SMALL, 8, cl).max_seq


# -- the command line ------------------------------------------------------------------------------

def _accepted_by_the_main_job(path: str, gpus: int, model: str, seq: int):
    from ds_seqpar.memory.config import MemoryConfig
    from ds_seqpar.train.args import build_parser
    from ds_seqpar.train.main import build_ds_config, check_run, load_hf_config
    from ds_seqpar.zero import check_ds_config
    cfg = SequenceParallelConfig.from_ds_config(path)
    cfg.check_world(gpus)
    with open(path) as f:
        ds = json.load(f)
    check_ds_config(ds, cfg.size, gpus // cfg.size)
    MemoryConfig.from_ds_config(ds, cfg)
    opts = build_parser().parse_args(["--deepspeed_config", path, "--model", model, "--seq_len", str(seq)])
    sp_cfg = SequenceParallelConfig.from_ds_config(build_ds_config(opts))
    check_run(sp_cfg, opts, None, load_hf_config(opts, sp_cfg, ds))
    return cfg, ds


def test_out_json_is_accepted_by_the_main_job(tmp_path, capsys):
    out = tmp_path / "ds.json"
    # 40M tokens of the small Llama do not fit one H100
    rc = plan_main(["--model", LLAMA, "--seq-len", str(40 << 20), "--gpus", "8", "--gpus-per-node", "8", "--zero", "3",
                    "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "rank" in text and "rejected" in text
    cfg, ds = _accepted_by_the_main_job(str(out), 8, LLAMA, 40 << 20)
    assert cfg.size > 1 and ds["zero_optimization"]["stage"] == 3


def test_out_json_is_accepted_by_training_arguments(tmp_path, capsys):
    """transformers checks a DeepSpeed JSON against the Trainer's arguments: the plan writes what it chose
    (one sequence per rank, bf16) and leaves what the arguments own as "auto", so the defaults pass."""
    from transformers import TrainingArguments
    out = tmp_path / "ds.json"
    assert plan_main(["--model", LLAMA, "--seq-len", str(40 << 20), "--gpus", "8", "--zero", "3",
                      "--out", str(out)]) == 0
    capsys.readouterr()
    bf16 = json.loads(out.read_text()).get("bf16", {}).get("enabled", False)
    args = TrainingArguments(output_dir=str(tmp_path), deepspeed=str(out), per_device_train_batch_size=1,
                             bf16=bf16, use_cpu=True, report_to=[])

    class Model:
        config = type("Config", (), {"hidden_size": 64})
    args.hf_deepspeed_config.trainer_config_finalize(args, Model(), 10)      # raises on any mismatch
    filled = args.hf_deepspeed_config.config
    assert filled["optimizer"]["params"]["lr"] == args.learning_rate and filled["train_micro_batch_size_per_gpu"] == 1
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu=1 vs hf per_device_train_batch_size=8"):
        TrainingArguments(output_dir=str(tmp_path), deepspeed=str(out), bf16=bf16, use_cpu=True,
                          report_to=[]).hf_deepspeed_config.trainer_config_finalize(args, Model(), 10)


def test_hybrid_out_json_names_the_linear_strategy(tmp_path, capsys):
    out = tmp_path / "ds.json"
    rc = plan_main(["--model", HYBRID, "--seq-len", str(16 << 20), "--gpus", "4", "--gpus-per-node", "4", "--zero", "2",
                    "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    cfg, ds = _accepted_by_the_main_job(str(out), 4, HYBRID, 16 << 20)
    assert cfg.size > 1 and "linear_strategy" in ds["sequence_parallel"] and cfg.strategy != "striped"


def test_bad_inputs(tmp_path, capsys):
    assert plan_main(["--model", LLAMA, "--seq-len", "4096", "--gpus", "8", "--gpu", "h300"]) == 2
    assert "choose one of a100, b200, h100, h200" in capsys.readouterr().err
    assert plan_main(["--model", str(tmp_path), "--seq-len", "4096", "--gpus", "8"]) == 2
    assert "without config.json" in capsys.readouterr().err
    assert plan_main(["--model", LLAMA, "--seq-len", "4096", "--gpus", "12", "--gpus-per-node", "8"]) == 2
    assert "whole number of nodes" in capsys.readouterr().err


def test_a_sequence_nothing_fits_says_what_would(capsys):
    gpu = hardware.load_gpu("a100")
    longest = longest_sequence(SMALL, Cluster(2, 8, gpu, "bf16"), zero=3)
    seq = 3 * longest
    rc = plan_main(["--model", LLAMA, "--seq-len", str(seq), "--gpus", "2", "--gpus-per-node", "8", "--gpu", "a100",
                    "--zero", "3"])
    err = capsys.readouterr().err
    assert rc == 1 and "longest sequence these GPUs fit is" in err and "would fit it" in err
    need = int(err.split("tokens; ")[1].split(" x ")[0])
    from ds_seqpar.plan.main import load_model
    shape = load_model(LLAMA)
    assert longest_sequence(shape, Cluster(need, 8, gpu, "bf16"), zero=3) >= seq
    assert longest_sequence(shape, Cluster(need // 2, 8, gpu, "bf16"), zero=3) < seq


# -- --calibrate's arithmetic (the measurement itself needs ranks: not here) ------------------------

def test_alpha_beta_fit_recovers_a_line():
    from ds_seqpar.plan.measure import fit_alpha_beta
    points = [(b, 2e-4 + b / 3e9) for b in (1 << 14, 1 << 18, 1 << 20, 1 << 24)]
    fit = fit_alpha_beta(points)
    assert fit["alpha_s"] == pytest.approx(2e-4, rel=1e-6) and fit["beta_bytes_s"] == pytest.approx(3e9, rel=1e-6)


def test_calibrated_speedups_are_the_compute_bounds_when_comm_is_free():
    from ds_seqpar.plan.calibrate import predict_speedups
    free = {"alpha_s": 0.0, "beta_bytes_s": 1e30}
    meta = {"world": 2, "dtype": "fp32", "heads": 8, "kv_heads": 8, "head_dim": 64, "batch": 1}
    got = predict_speedups({"all_to_all": free, "ring": free}, {"attention_flops_s": 1e10}, meta, 8192)
    assert got["ulysses"] == pytest.approx(2.0) and got["zigzag"] == pytest.approx(2.0)
    assert got["ring"] == pytest.approx(4 / 3)             # P^2 / (2P - 1): the causal contiguous ring
    slow = {"alpha_s": 1e-3, "beta_bytes_s": 1e8}
    worse = predict_speedups({"all_to_all": slow, "ring": slow}, {"attention_flops_s": 1e10}, meta, 8192, overlap=False)
    assert all(worse[s] < got[s] for s in got)


def test_calibrate_report_memory_rows_follow_the_measurements(tmp_path):
    """--calibrate reads the memory benchmark's rows: the fitted phase slopes (KiB per token) of a variant
    measured at two lengths, against the plan's count."""
    from ds_seqpar.plan.calibrate import Run, memory_rows
    from ds_seqpar.report.rows import Row, save_rows
    base = {"model": "llama", "world": 1, "features": False, "hidden": 256, "layers": 8, "heads": 8, "kv_heads": 2,
            "intermediate": 688, "vocab": 32000, "tiled_loss_tokens": 256, "tiled_mlp_tokens": 1024, "strategy": "zigzag"}
    rows = [Row("memory", "llama", "P=1 off", "Bytes per token of each phase (KiB, fitted slope)", "KiB", 400_000 / 1024,
                detail={"forward": 400_000 / 1024, "optimizer": 0.0})]
    rows += [Row("memory", "llama", f"P=1 off, {n} tokens/rank", "Every measurement: peak per rank of the whole step "
                 "(MiB)", "MiB", 1e3) for n in (1024, 2048)]
    save_rows(str(tmp_path / "memory.rows.json"), rows, {"meta": base})
    rows = memory_rows(Run(str(tmp_path / "memory.rows.json")))
    assert len(rows) == 1 and rows[0].value == pytest.approx(400_000)
    assert rows[0].predicted == max(memory.per_token(_shape_of(base, False), 4, Features(), True).values())


def test_the_cost_model_imports_only_the_core():
    """The cost model (everything but the command line and --calibrate) stays importable by the core's
    users, bench included: it imports nothing of hf, launch, train, bench or report."""
    import ast
    import ds_seqpar.plan as plan_pkg
    from tests.unit.test_layers import CORE
    folder = os.path.dirname(plan_pkg.__file__)
    tools_only = {"main.py", "inputs.py", "measure.py", "calibrate.py", "calibrate_report.py"}
    bad = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py") or name in tools_only:
            continue
        tree = ast.parse(open(os.path.join(folder, name)).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level >= 1:
                tops = [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
                if node.level == 2 and any(t not in CORE for t in tops):
                    bad.append(f"{name}: from {'.' * node.level}{node.module or ''} import {tops}")
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                mod = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                if mod and mod.startswith("ds_seqpar.") and mod.split(".")[1] not in CORE | {"plan"}:
                    bad.append(f"{name}: import {mod}")
    assert not bad, bad


def test_json_output_has_the_phases(tmp_path, capsys):
    out = tmp_path / "all.json"
    assert plan_main(["--model", LLAMA, "--seq-len", "65536", "--gpus", "2", "--zero", "2", "--json", str(out)]) == 0
    best = json.loads(out.read_text())["feasible"][0]
    n = -(-65536 // best["size"])
    peak = max(line["a"] + line["b"] * n for line in best["phases"].values())
    assert peak == pytest.approx(best["peak_bytes"]) and set(best["phases"]) == set(memory.PHASES)


def test_the_command_is_registered(capsys):
    from ds_seqpar.cli import main as cli_main
    assert cli_main(["plan", "--model", LLAMA, "--seq-len", "4096", "--gpus", "1", "--zero", "2", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "rank" in out and "tokens/s" in out
    cli_main(["--help"])
    assert "plan" in capsys.readouterr().out
