"""The dynamic data-sequence scheduler (pure arithmetic): rounds.py places documents on groups,
cost.py prices them. The runtime that executes a schedule is ds_seqpar.dynamic."""
from .cost import ModelShape, price
from .rounds import Group, MicroBatch, Schedule, family_groups, group_sizes, schedule

__all__ = ["Group", "MicroBatch", "ModelShape", "Schedule", "family_groups", "group_sizes", "price", "schedule"]
