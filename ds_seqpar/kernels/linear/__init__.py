"""Causal linear attention with optional per-head decay, on one process.

    forward.py    the chunked forward in phases (what LASP overlaps with communication), the entry
                  point ``linear_attention`` and its autograd function
    backward.py   the matching backward phases
    common.py     input checks, decay tables, the chunked block layout and the state scans
    naive.py      the quadratic reference the fast path is tested against
"""
from .backward import BlockBackward, backward_begin, backward_finish, backward_local, chunked_backward, intra_backward
from .common import check_inputs, state_decay, state_dtype
from .forward import (BlockForward, LinearAttentionFunction, chunked_forward, forward_begin, forward_diagonal,
                      forward_finish, forward_states, intra_forward, linear_attention)
from .naive import linear_attention_reference

__all__ = ["BlockBackward", "BlockForward", "LinearAttentionFunction", "backward_begin", "backward_finish",
           "backward_local", "check_inputs", "chunked_backward", "chunked_forward", "forward_begin",
           "forward_diagonal", "forward_finish", "forward_states", "intra_backward", "intra_forward",
           "linear_attention", "linear_attention_reference", "state_decay", "state_dtype"]
