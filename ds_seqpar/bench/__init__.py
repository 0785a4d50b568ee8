"""`ds-seqpar bench`: every strategy against one process, side by side in one run."""
