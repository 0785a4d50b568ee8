"""The main job's --lengths pieces without processes: reading a lengths file, the seeded documents
of a step, and the options refused before any rank joins the world."""
import gzip

import numpy as np
import pytest

from ds_seqpar import SequenceParallelConfig
from ds_seqpar.train import data
from ds_seqpar.train.args import TrainConfigError, resolve_args
from ds_seqpar.train.documents import check_options


def test_lengths_files_plain_and_gzip(tmp_path):
    plain, packed = tmp_path / "l.txt", tmp_path / "l.txt.gz"
    plain.write_text("12\n 7\n\n300\n")
    with gzip.open(packed, "wt") as f:
        f.write("12\n7\n300\n")
    assert data.read_lengths(str(plain)).tolist() == data.read_lengths(str(packed)).tolist() == [12, 7, 300]


@pytest.mark.parametrize("text, words", [("", "is empty"), ("\n\n", "is empty"), ("5\n-2\n", "line 2 is -2"),
                                         ("5\n0\n", "line 2 is 0; document lengths must be >= 1"),
                                         ("5\nten\n", "'ten' is not an integer")])
def test_bad_lengths_files_name_the_line_and_what_works(tmp_path, text, words):
    path = tmp_path / "l.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=words):
        data.read_lengths(str(path))
    with pytest.raises(ValueError, match="does not exist"):
        data.read_lengths(str(tmp_path / "missing.txt"))


def test_a_step_has_exactly_its_tokens_the_same_documents_everywhere_and_cuts_counted():
    tokens = np.arange(5000, dtype=np.uint16) % 256
    lengths = np.array([10, 40, 3000, 7])
    docs, cut = data.documents_for_step(tokens, lengths, 3, 2000, 100, seed=1)
    again, _ = data.documents_for_step(tokens, lengths, 3, 2000, 100, seed=1)
    assert sum(d.numel() for d in docs) == 2000 and all(d.numel() <= 100 for d in docs)
    assert [d.tolist() for d in docs] == [d.tolist() for d in again]
    drawn_long = sum(d.numel() == 100 for d in docs)
    assert cut >= drawn_long - 1 and cut >= 1, (cut, [d.numel() for d in docs])
    other, _ = data.documents_for_step(tokens, lengths, 4, 2000, 100, seed=1)
    assert [d.tolist() for d in other] != [d.tolist() for d in docs], "each step draws its own documents"


def _opts(**kw):
    return resolve_args(dict({"quiet": True}, **kw))


def test_options_that_do_not_go_with_lengths_are_refused(tmp_path):
    dynamic = SequenceParallelConfig.parse({"size": "dynamic", "max_tokens_per_rank": 64, "strategy": "zigzag"})
    static = SequenceParallelConfig.parse({"size": 2, "strategy": "zigzag"})
    with pytest.raises(TrainConfigError, match="pass --lengths FILE"):
        check_options(_opts(), dynamic, None)
    with pytest.raises(TrainConfigError, match="--tokens_per_step=64 goes with --lengths FILE only"):
        check_options(_opts(tokens_per_step=64), static, None)
    with pytest.raises(TrainConfigError, match="--ignore_frac=0.25 with --lengths"):
        check_options(_opts(lengths="x.txt", ignore_frac=0.25), static, None)
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("5\n7\n")
    assert list(check_options(_opts(lengths=str(lengths)), dynamic, object())) == [5, 7]     # --model too
    assert check_options(_opts(), static, None) is None


def test_the_command_line_check_lets_dynamic_through_before_starting_ranks():
    """The launcher-side check (--nprocs or a launcher's world) takes any world with size dynamic:
    the groups come from schedule.group_sizes, not from size | world."""
    from ds_seqpar.train.preflight import check_config
    _, cfg = check_config(_opts(sp_size="dynamic", max_tokens_per_rank=64, lengths="x.txt"), 4)
    assert cfg.is_dynamic
    _, cfg = check_config(_opts(sp_size=2), 4)
    assert cfg.size == 2
