"""``ds-seqpar plan --lengths`` on tiny inputs, without processes: the length files it refuses, the
balance bound, Megatron's power-of-two rule, ours against power-of-two on a constructed case, the
critical path of rounds, and the step rates fitted from measured steps (cost/steps.py)."""
import gzip

import pytest

from ds_seqpar.cost.steps import StepRates, document_s, fit_rates
from ds_seqpar.plan import hardware
from ds_seqpar.plan.lengths import predict_cluster
from ds_seqpar.plan.main import main
from ds_seqpar.cost.model_shape import ModelShape
from ds_seqpar.plan.search import Cluster
from ds_seqpar.schedule import critical_path_s, read_lengths, schedule

SMALL = ModelShape("small", hidden=256, layers=4, heads=8, kv_heads=2, head_dim=32, intermediate=688, vocab=1000)
CAP = 2048


@pytest.mark.parametrize("text, words", [("", "is empty"), ("\n \n", "is empty"),
                                         ("5\n\n0\n", "line 3, non-empty line 2 is 0"),
                                         ("7\n-4\n", "line 2 is -4"), ("5\nten\n", "line 2: 'ten' is not an")])
def test_a_bad_lengths_file_is_refused_naming_the_file_and_line(tmp_path, capsys, text, words):
    path = tmp_path / "bad.txt.gz"
    with gzip.open(path, "wt") as f:
        f.write(text)
    with pytest.raises(ValueError, match=words):
        read_lengths(str(path))
    assert main(["--lengths", str(path), "--model", "configs/plan/llama3_8b.json", "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and words in err, err


@pytest.fixture(scope="module")
def cases():
    cl = Cluster(8, 8, hardware.load_gpu("h100"))
    lengths = [2000, 1500, 900] + [100] * 40 + [300] * 12
    return lengths, cl, predict_cluster(SMALL, lengths, cl, CAP)


def test_the_balance_bound_is_every_documents_work_on_one_rank_over_the_gpus(cases):
    lengths, cl, out = cases
    one = out["bound"]["candidate"]                      # the dynamic cases' ZeRO stage and features, one rank
    assert (one.strategy, one.size) == ("zigzag", 1)
    per_doc = [document_s(one, SMALL, n, cl.gpu, 8, "bf16") for n in lengths]
    assert out["bound"]["step_s"] == pytest.approx(sum(per_doc) / 8, rel=1e-12)
    for case, got in out.items():
        if case not in ("bound", "documents"):
            assert got["step_s"] >= out["bound"]["step_s"], case


def test_power_of_two_puts_each_document_on_the_smallest_power_of_two_group_holding_it():
    lengths, t = [700, 90, 300, 60, 250, 1300, 120, 40], 400
    sched = schedule(lengths, 8, t, (1, 2, 4, 8), fill_groups=False)
    for row in sched.rounds:
        for mb in row:
            for d in mb.documents:
                smallest = min(g for g in (1, 2, 4, 8) if g * t >= lengths[d])
                assert mb.group.size == smallest, (lengths[d], mb.group)
    filled = schedule(lengths, 8, t, (1, 2, 4, 8))
    assert any(mb.group.size > 1 and min(mb.lengths) <= t for row in filled.rounds for mb in row), \
        "ours fills a group's room with short documents (the case below relies on it)"


def test_ours_is_not_slower_than_power_of_two_on_a_constructed_case():
    # a 700-token document on 2 ranks leaves room that ours fills; power-of-two waits at every round
    lengths, t = [700, 1300, 600] + [380, 350, 330, 300, 90, 60, 40] * 3, 400
    price = lambda n, g: n / g + (n / g) ** 2 / 400 + (5.0 if g > 1 else 0.0)   # noqa: E731
    ours = schedule(lengths, 8, t, (1, 2, 4, 8), pricer=price)
    pow2 = schedule(lengths, 8, t, (1, 2, 4, 8), pricer=price, fill_groups=False)
    assert critical_path_s(ours, 1.0) < critical_path_s(pow2, 1.0, barrier=True)


def test_rounds_strung_along_their_ranks():
    price = lambda n, g: float(n) / g   # noqa: E731
    sched = schedule([800, 300, 100, 400], 2, 400, (1, 2), pricer=price)
    # round 0: [800] on both ranks (400 each); then 300 + 100 on one rank and 400 on the other
    assert [len(sched.rounds), sorted(sched.rank_costs)] == [2, [800.0, 800.0]]
    assert critical_path_s(sched, 10.0) == pytest.approx(820.0)
    skewed = schedule([800, 399, 1], 2, 400, (1, 2), pricer=price)
    assert critical_path_s(skewed, 0.0) == pytest.approx(799.0)
    assert critical_path_s(skewed, 0.0, barrier=True) == pytest.approx(799.0)


def test_step_rates_fitted_from_steps_recover_the_rates_that_made_them():
    true = StepRates(2e-9, 3e-9, 5e-9, 0.03, 0.1)
    steps = [(1e8, 1e7, 0, 1), (3e8, 5e7, 1e7, 2), (5e7, 1e8, 4e7, 5), (2e8, 0, 2e7, 3), (4e8, 2e8, 0, 2),
             (1e8, 3e7, 3e7, 4), (2e8, 4e8, 1e6, 1)]
    got = fit_rates([(*step, true.seconds(*step)) for step in steps])
    for name in ("s_per_op", "s_per_attention_op", "s_per_byte", "round_s", "step_s"):
        assert getattr(got, name) == pytest.approx(getattr(true, name), rel=1e-6), name
    assert got.flops_per_byte == pytest.approx(2.5)


def test_lengths_without_a_model_or_with_no_tokens_is_refused(capsys):
    assert main(["--lengths", "data/lengths/wlbllm.txt"]) == 2
    assert "--lengths needs --model" in capsys.readouterr().err
    assert main(["--lengths", "data/lengths/wlbllm.txt", "--model", "configs/plan/llama3_8b.json",
                 "--tokens-per-gpu", "0"]) == 2
    assert "--tokens-per-gpu=0" in capsys.readouterr().err


def test_the_scheduler_and_the_planner_price_a_document_identically(monkeypatch):
    """One price of a document (cost/documents.py): the planner's placement price is the runtime's
    function at the GPU's rates, its default the same function at the scheduler's rates, and the rounds
    plan --lengths predicts for ours are the ones DynamicSequenceParallel.schedule makes given that price."""
    import types
    from ds_seqpar import schedule as sched
    from ds_seqpar.config import SequenceParallelConfig
    from ds_seqpar.cost import documents
    from ds_seqpar.cost.candidate import Candidate, Features
    from ds_seqpar.dynamic import DynamicSequenceParallel
    from ds_seqpar.plan import lengths as plan_lengths
    cl = Cluster(8, 8, hardware.load_gpu("h100"))
    planner, rates = plan_lengths.placement_pricer("zigzag", SMALL, cl), documents.gpu_rates(cl.gpu, cl.dtype)
    for n, g in [(1, 1), (100, 1), (900, 2), (1537, 4), (2048, 8)]:
        linear, attention, sent = documents.work(n, g, "zigzag", SMALL, elem=2)
        by_hand = linear * rates.s_per_op + attention * rates.s_per_attention_op + sent * rates.s_per_byte
        assert planner(n, g) == documents.price(n, g, "zigzag", SMALL, rates=rates, elem=2) == by_hand > 0
        linear, attention, sent = documents.work(n, g, "zigzag", SMALL)                       # fp32 bytes
        assert sched.price(n, g, "zigzag", SMALL) == documents.price(n, g, "zigzag", SMALL) == \
            linear + attention + 100.0 * sent                                                # operations
    assert sched.price is documents.price and sched.DocumentPricer is documents.DocumentPricer
    # the placement: plan --lengths' ours against the runtime's own schedule() with the planner's price
    made = []
    real = plan_lengths.schedule
    monkeypatch.setattr(plan_lengths, "schedule", lambda *a, **k: made.append((a, k, real(*a, **k))) or made[-1][2])
    lengths, t = [2000, 1500, 900] + [100] * 40 + [300] * 12, 256
    c = Candidate("zigzag", 1, 1, 1, Features())
    plan_lengths.run_case(lengths, sched.group_sizes(8), t, [c], lambda g: Candidate("zigzag", g, 1, 1, Features()),
                          SMALL, cl)
    (_, kwargs, predicted), = made
    config = SequenceParallelConfig.parse({"strategy": "zigzag", "size": "dynamic", "max_tokens_per_rank": t})
    runtime = types.SimpleNamespace(world_size=8, max_tokens_per_rank=t, sizes=sched.group_sizes(8), config=config,
                                    heads=None)
    ran = DynamicSequenceParallel.schedule(runtime, lengths, shape=SMALL, round_price=kwargs["round_price"],
                                           pricer=plan_lengths.placement_pricer("zigzag", SMALL, cl))
    assert ran.rounds == predicted.rounds and ran.rank_costs == predicted.rank_costs
    assert len(predicted.group_sizes) > 1
