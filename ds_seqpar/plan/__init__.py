"""``ds-seqpar plan``: which strategy, sizes, ZeRO stage and memory features for a model, a sequence
length and a cluster, priced by the cost model (ds_seqpar/cost/, core: the runtime prices with it too),
and ``--calibrate``, which checks that model against what the bench measured here. docs/design.md lists
the modules, docs/plan.md the model and how its predictions compare with published and measured results.
"""
