"""The dynamic data-sequence scheduler (pure arithmetic): rounds.py places documents on groups,
cost.py prices them, timing.py strings their rounds along the ranks, lengths.py reads length
files. The runtime that executes a schedule is ds_seqpar.dynamic."""
from .cost import ModelShape, price, work
from .batch import Group, MicroBatch
from .lengths import draw_lengths, read_lengths
from .rounds import Schedule, family_groups, group_sizes, schedule
from .timing import critical_path_s, rank_work

__all__ = ["Group", "MicroBatch", "ModelShape", "Schedule", "critical_path_s", "draw_lengths", "family_groups",
           "group_sizes", "price", "rank_work", "read_lengths", "schedule", "work"]
