"""The zoo: tiny random-init models of every family the installed transformers has (built from each
family's own config class), the sweeps that run them under every strategy, and the generators of the
tables docs/models.md and docs/generation.md quote (``python -m tests.zoo.decoders``, ``tests.zoo.vlm_table``,
``tests.zoo.generate``). tests/dist runs the sweeps; the shared fixtures stay one level up (reference.py,
hf_models.py, dist_checks.py, train_reference.py)."""
