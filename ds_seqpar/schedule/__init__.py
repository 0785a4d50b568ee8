"""The dynamic data-sequence scheduler (pure arithmetic): family.py says which groups exist,
rounds.py places documents on them, priced by the cost model (cost/documents.py: ``price``, re-exported
here with its model shape), timing.py strings their rounds along the ranks, lengths.py reads length
files. The runtime that executes a schedule is ds_seqpar.dynamic."""
from ..cost.documents import DocumentPricer, price, work
from ..cost.model_shape import ModelShape
from .batch import Group, MicroBatch
from .family import check_max_tokens, family_groups, family_sizes, group_sizes, ulysses_degree
from .lengths import draw_lengths, read_lengths
from .rounds import Schedule, schedule
from .timing import critical_path_s, rank_work

__all__ = ["DocumentPricer", "Group", "MicroBatch", "ModelShape", "Schedule", "check_max_tokens", "critical_path_s", "draw_lengths",
           "family_groups", "family_sizes", "group_sizes", "price", "rank_work", "read_lengths", "schedule",
           "ulysses_degree", "work"]
