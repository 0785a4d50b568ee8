"""The band cutter lives in kernels/bands.py (a kernel's default ``band`` uses it); bench/window.py
still imports its sub-block type and pair count from here."""
from ..kernels.bands import SubBlock, visible_pairs

__all__ = ["SubBlock", "visible_pairs"]
