"""Starting ranks: local spawning for the main job (spawn.py), the reusable rank pool of the tests
and benchmarks (rankpool.py), the rank environment both share (env.py), and
every rank's host, gathered once at start (hosts.py)."""
