"""The linear-attention, SSM and convolution layers of Hugging Face hybrids under sequence parallelism
(docs/hybrids.md), one small file per family, each wrapping transformers' own op:

    families.py    which layer classes call which module-level ops (a leaf: checks.py reads it)
    seams.py       the seams on those ops and the per-layer hooks that say which layer is running
    mixers.py      LinearMixers: one applied (sp, model) pair's ops, over sp.linear_exchange
    fold.py        o = o0 + Q~ . S_in once the exchange gave the entering states
    conv.py        short causal convolutions: the halo of the K-1 inputs before each run
    delta_rule.py  gated DeltaNet and Kimi delta attention (one op signature): the widened call
    ssd.py         Mamba2's chunked scan: the plain call and a width-1 probe of the decays
    selective_scan.py  Mamba-1's scan (no initial state): the call from zero plus the entering state's share
    lightning.py   MiniMax's lightning attention: no op to hook, the forward is replaced
    opaque.py      under torch.compile, a seam call as one opaque op (its backward reruns the eager path)
"""
