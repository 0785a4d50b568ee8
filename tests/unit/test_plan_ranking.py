"""The planner's ranking: a memory headroom every configuration must leave free, and near-ties in
predicted tokens/s broken toward fewer moving parts, then more free memory."""
from ds_seqpar.plan import hardware
from ds_seqpar.cost.candidate import Candidate, Features
from ds_seqpar.plan.search import NEAR_TIE, Cluster, Prediction, predict, rank

from .test_plan import SMALL


def _pred(name, tokens_s, peak_gb, u=1, on=False):
    c = Candidate(name, 8, u, 2, Features(on=on))
    return Prediction(c, 1, ok=True, budget_bytes=90e9, headroom=0.10, peak_bytes=peak_gb * 1e9, tokens_s=tokens_s)


def test_near_ties_go_to_fewer_moving_parts_then_more_free_memory():
    crowded = _pred("zigzag", 1000.0, 97.6)                       # 2.4% free
    roomy = _pred("striped", 1000.0 * (1 - NEAR_TIE / 2), 37.7)    # as fast within the model's precision
    hybrid = _pred("ring", 1001.0, 20.0, u=4)                      # a 2D layout: one more thing to get right
    slower = _pred("ulysses", 900.0, 10.0)                         # a real difference stays ahead of memory
    assert [p.candidate.strategy for p in rank([crowded, slower, hybrid, roomy])] == \
        ["striped", "zigzag", "ring", "ulysses"]
    assert roomy.free > 0.6 and crowded.free < 0.03


def test_headroom_refuses_a_configuration_that_fits_only_without_it():
    gpu = hardware.load_gpu("h100")
    c, cl = Candidate("zigzag", 8, 1, 3, Features()), Cluster(8, 8, gpu, "bf16")
    longest = predict(c, SMALL, 8, cl, headroom=0.0).max_seq
    seq = int(longest * 0.95) // 8 * 8                             # fits the whole memory, not 90% of it
    assert predict(c, SMALL, seq, cl, headroom=0.0).ok
    tight = predict(c, SMALL, seq, cl, headroom=0.10)
    assert not tight.ok and "with 10% headroom" in tight.reason
    assert tight.max_seq < longest
