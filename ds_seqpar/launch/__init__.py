"""Starting ranks: local spawning for the main job (spawn.py), the reusable rank pool of the tests
and benchmarks (rankpool.py), and the rank environment both share (env.py)."""
