"""`ds-seqpar report`: compare training runs (tables and plots)."""
