"""The dynamic data-sequence scheduler (pure arithmetic): family.py says which groups exist,
rounds.py places documents on them, cost.py prices them. The runtime that executes a schedule is
ds_seqpar.dynamic."""
from .cost import ModelShape, price
from .family import check_max_tokens, family_groups, family_sizes, group_sizes, ulysses_degree
from .rounds import Group, MicroBatch, Schedule, schedule

__all__ = ["Group", "MicroBatch", "ModelShape", "Schedule", "check_max_tokens", "family_groups", "family_sizes", "group_sizes", "price",
           "schedule", "ulysses_degree"]
