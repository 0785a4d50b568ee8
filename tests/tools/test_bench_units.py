"""``ds-seqpar bench`` pieces that start no rank: the closed-form oracle's edge cases, the option
checks and presets, the summary's bounds and search, and the markdown pages of the committed reports
re-rendered from their rows."""
import glob
import os

import pytest

from ds_seqpar.strategies.closed_form import Shapes, closed_form_by_kind, closed_form_bytes

REPORTS = os.path.join(os.path.dirname(__file__), "..", "..", "reports")


def test_closed_form_bytes_edge_cases():
    sh = Shapes(batch=2, seq=1024, heads=8, kv_heads=8, head_dim=64, elem=2)
    assert closed_form_bytes("zigzag", 1, sh) == 0 and closed_form_by_kind("lasp", 1, sh) == {}
    # ring family: S_kv (P-1) (4e + 2*4); bf16 halves only the k/v part, not the fp32 accumulators
    assert closed_form_bytes("ring", 2, sh) == 2 * 512 * 8 * 64 * 1 * (4 * 2 + 8)
    assert closed_form_by_kind("ring", 2, sh) == {"ring": 2 * 512 * 8 * 64 * 4 * 2, "ring_grad": 2 * 512 * 8 * 64 * 8}
    # Ulysses MHA: 8 all-to-alls of (P-1)/P of one local full-head tensor
    assert closed_form_bytes("ulysses", 4, sh) == 8 * 2 * (2 * 256 * 8 * 64) * 3 // 4
    # LASP-1: the first rank only sends a state, the last only a dstate; LASP-2 (P-1) of each
    state = 2 * 8 * 64 * 64 * 4
    assert closed_form_by_kind("lasp", 4, sh, rank=0, lasp_comm="ring") == {"lasp_state": state}
    assert closed_form_by_kind("lasp", 4, sh, rank=3, lasp_comm="ring") == {"lasp_dstate": state}
    for rank in range(4):                   # All-Scan sends what the ring does, in blocks
        assert closed_form_by_kind("lasp", 4, sh, rank, lasp_comm="allscan") == \
            closed_form_by_kind("lasp", 4, sh, rank, lasp_comm="ring")
    assert closed_form_bytes("lasp", 4, sh, rank=1) == 2 * 3 * state
    with pytest.raises(ValueError, match="no closed form for strategy 'nope'"):
        closed_form_bytes("nope", 2, sh)


@pytest.mark.parametrize("argv,message", [
    (["--dtype", "bf16"], "--dtype bf16 needs CUDA"),
    (["--backend", "flash_attn"], "--backend flash_attn needs CUDA"),
    (["--device", "cuda"], "CUDA is not available"),
    (["--strategies", "zigzag,nope"], "unknown case 'nope'"),
    (["--seq-lens", "102"], "multiple of 4"),
    (["--heads", "3", "--kv-heads", "1"], "not divisible by --P 2"),
    (["--heads", "4", "--kv-heads", "3"], "q heads (4) must be a multiple of k/v heads (3)"),
], ids=["bf16", "flash_attn", "cuda", "strategy", "seq", "heads", "gqa"])
def test_bench_rejects_bad_options_before_starting_ranks(argv, message):
    import torch

    from ds_seqpar.bench.attention import BenchError, build_parser, resolve
    if torch.cuda.is_available() and argv[0] in ("--dtype", "--backend", "--device"):
        pytest.skip("these options are valid on a CUDA machine")
    # resolve() is where every check runs; it starts nothing, so a check that fails to fire cannot
    # turn into a benchmark run here
    with pytest.raises(BenchError) as err:
        resolve(build_parser().parse_args(argv))
    assert message in str(err.value), str(err.value)


def test_bench_command_exits_2_with_the_message(capsys):
    from ds_seqpar.bench.main import main
    assert main(["--strategies", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ds-seqpar bench: error: --strategies: unknown case 'nope'"), err


def test_cli_lists_bench_and_report(capsys):
    from ds_seqpar.cli import main
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "bench" in out and "report" in out, out


@pytest.mark.parametrize("preset,cases,breakdown", [
    ("quick", ["single", "ulysses", "ring", "zigzag", "striped", "ds_ulysses", "single_linear", "lasp2", "lasp1",
                "allscan"], False),
    ("ring", ["single", "ulysses", "ring", "zigzag", "striped", "zigzag_no_overlap"], False),
    ("lasp", ["single_linear", "lasp2", "lasp1", "allscan", "halves"], True),
])
def test_presets(preset, cases, breakdown):
    # ring and lasp are the former python -m ds_seqpar.bench_ring / bench_lasp: one family at N=8192
    from ds_seqpar.bench.attention import build_parser, resolve
    args = resolve(build_parser().parse_args(["--preset", preset]))
    assert args.cases == cases and args.lasp_breakdown == breakdown and args.name == f"cpu_{preset}", vars(args)
    if preset != "quick":
        assert (args.seq_lens, args.P, args.train, args.mem_budget_n) == ([8192], 2, [], 0), vars(args)
    # an explicit option wins over the preset's value
    args = resolve(build_parser().parse_args(["--preset", preset, "--strategies", "zigzag", "--seq-lens", "64"]))
    assert (args.cases, args.seq_lens) == (["single", "zigzag"], [64])


def test_bounds_and_the_longest_sequence_search():
    from ds_seqpar.bench.cases import _largest
    from ds_seqpar.cost import expected_imbalance, speedup_bound
    assert speedup_bound("ring", 2, True) == pytest.approx(4 / 3) and speedup_bound("ring", 2, False) == 2.0
    assert speedup_bound("zigzag", 4, True) == 4.0 and expected_imbalance("ring", 4, True) == pytest.approx(7 / 4)
    probed = []

    def fits(n):
        probed.append(n)
        return n <= 448
    assert _largest(fits, 64, limit=4096) == 448 and len(probed) <= 8, probed
    assert _largest(lambda n: False, 64, limit=4096) == 0
    # the limit stops the doubling, so a case that saves nothing cannot probe forever
    assert 256 <= _largest(lambda n: True, 64, limit=256) < 2 * 256


def test_bench_training_case_takes_a_hugging_face_model(tmp_path):
    from ds_seqpar.bench.attention import BenchError, _train_model, build_parser, resolve
    path = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "configs", "models", "qwen2_small.json")
    args = resolve(build_parser().parse_args(["--model", path, "--train-strategies", "zigzag,ulysses",
                                              "--train-seq-len", "256"]))
    assert _train_model(args) == {"model": os.path.abspath(path), "seq_len": 256, "micro_batch": 1, "steps": 3}
    with pytest.raises(BenchError, match="--train-strategies lasp: Hugging Face models use softmax attention"):
        resolve(build_parser().parse_args(["--model", path, "--train-strategies", "zigzag,lasp"]))
    with pytest.raises(BenchError, match="does not exist"):
        resolve(build_parser().parse_args(["--model", str(tmp_path / "nope")]))


def test_bench_runs_a_suite_by_name_and_the_old_flags_as_aliases(capsys):
    from ds_seqpar.bench.main import main, suite_of
    assert suite_of(["window", "--P", "2"]) == ("window", ["--P", "2"])
    assert suite_of(["memory"]) == ("memory", [])
    assert suite_of(["--preset", "quick"]) == ("attention", ["--preset", "quick"])
    assert capsys.readouterr().err == ""
    for flag in ("--packed", "--window", "--hybrid", "--trainer"):
        assert suite_of(["--P", "2", flag]) == (flag[2:], ["--P", "2"])
        err = capsys.readouterr().err
        assert err == f"ds-seqpar bench: {flag} is deprecated; use `ds-seqpar bench {flag[2:]} ...`\n", err
    with pytest.raises(SystemExit, match="ds-seqpar bench packed: --seq 100 must be a multiple"):
        main(["packed", "--seq", "100"])           # the suite's own options and checks


# every committed page with its rows beside it (reports/lasp_allscan_cpu/'s rows feed one page of several runs)
COMMITTED = sorted(os.path.relpath(p, REPORTS)[:-len(".rows.json")]
                   for p in glob.glob(os.path.join(REPORTS, "**", "*.rows.json"), recursive=True)
                   if os.path.exists(p[:-len(".rows.json")] + ".md"))


@pytest.mark.parametrize("name", COMMITTED)
def test_every_committed_suite_page_is_its_rows_rendered(name):
    # the page is a function of the saved rows: a change to the layout must re-render the committed
    # reports (ds-seqpar bench [SUITE] --render reports/NAME.rows.json)
    from ds_seqpar.report.render import render
    from ds_seqpar.report.rows import load_rows
    with open(os.path.join(REPORTS, f"{name}.md")) as f:
        assert render(*load_rows(os.path.join(REPORTS, f"{name}.rows.json"))) == f.read(), \
            f"reports/{name}.md differs from its rows' rendering (re-render it)"


@pytest.mark.parametrize("suite,name", [("packed", "packed_cpu"), ("window", "window_cpu"), ("hybrid", "hybrid_cpu"),
                                        ("trainer", "hf_trainer_cpu"), ("memory", "memory_cpu")])
def test_render_rewrites_a_saved_report_unchanged(suite, name, tmp_path, capsys):
    """``ds-seqpar bench SUITE --render NAME.rows.json`` (memory: re-derived from the points in its facts):
    the page and the rows written beside it are the committed ones, byte for byte (the saved file is read,
    then written back)."""
    import shutil
    from ds_seqpar.bench.main import main
    saved = f"{name}.rows.json"
    shutil.copy(os.path.join(REPORTS, saved), tmp_path)
    assert main([suite, "--render", str(tmp_path / saved)]) == 0
    for ext in (".md", ".rows.json"):
        with open(os.path.join(REPORTS, name + ext)) as want, open(tmp_path / (name + ext)) as got:
            assert got.read() == want.read(), f"{suite} --render: {name}{ext} differs from the committed one"


def _load_only(args):
    return {"load_1min": 0.25}


def test_measure_on_pool_adds_the_versions_a_page_names_when_asked():
    """window and hybrid name the CPU model, torch and DeepSpeed on their page; packed does not."""
    import argparse
    import torch
    from ds_seqpar.bench.harness import measure_on_pool
    per_rank, meta = measure_on_pool(_load_only, argparse.Namespace(P=1), "cmd", versions=True)
    assert per_rank == [{"load_1min": 0.25}] and meta["command"] == "cmd" and meta["load_during"] == 0.25
    assert list(meta)[-3:] == ["cpu_model", "torch", "deepspeed"] and meta["torch"] == torch.__version__
    assert "torch" not in measure_on_pool(_load_only, argparse.Namespace(P=1), "cmd")[1]
