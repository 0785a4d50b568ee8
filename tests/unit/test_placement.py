"""topology.placement_problems: Ulysses groups stay inside a host, the launcher's local world
agrees with the host names (gathered at start, launch/hosts.py). Across real hosts: tests/multinode."""
from ds_seqpar.topology import ParallelDims, placement_problems


def hosts(*names, local=None):
    return [{"host": n, "addr": "", "local_world_size": local} for n in names]


def test_hybrid_with_ulysses_inside_each_host_is_fine():
    assert placement_problems(ParallelDims(4, 4, 2), hosts("a", "a", "b", "b", local=2)) == []
    assert placement_problems(ParallelDims(4, 4, 1), hosts("a", "b", "c", "d", local=1)) == []


def test_ulysses_across_hosts_is_named_with_its_key():
    (problem,) = placement_problems(ParallelDims(4, 4, 4), hosts("a", "a", "b", "b", local=2))
    assert problem.startswith("sequence_parallel.ulysses_size=4 puts all-to-all groups across hosts "
                              "(ranks 0, 1, 2, 3 on a, b)"), problem
    assert "With 2 rank(s) per host, ulysses_size dividing 2" in problem
    (problem,) = placement_problems(ParallelDims(4, 4, 4), hosts("a", "a", "b", "b"), key="sequence_parallel.size")
    assert problem.startswith("sequence_parallel.size=4 puts"), problem


def test_ranks_placed_round_robin_put_every_group_across_hosts():
    (problem,) = placement_problems(ParallelDims(4, 4, 2), hosts("a", "b", "a", "b", local=2))
    assert "(ranks 0, 1 on a, b)" in problem, problem


def test_a_launcher_local_world_that_disagrees_with_the_hosts():
    problems = placement_problems(ParallelDims(4, 4, 1), hosts("a", "a", "b", "b", local=4))
    assert problems[0] == "rank 0: the launcher says 4 ranks share its host 'a', but 2 do (ranks 0, 1)"
    assert len(problems) == 4


def test_the_main_job_warns_when_a_dynamic_2d_hybrids_all_to_all_crosses_hosts(monkeypatch, capsys):
    """size "dynamic": groups move with the schedule, but the 2D hybrid's all-to-all blocks of U
    ranks are fixed, so rank 0 says when one spans hosts (and nothing without the hybrid)."""
    from ds_seqpar import SequenceParallelConfig
    from ds_seqpar.train import main
    monkeypatch.setattr(main.hosts, "known", lambda: hosts("a", "b", "a", "b", local=2))
    monkeypatch.setattr(main.comm, "global_rank", lambda: 0)
    for u, warned in ((2, True), (1, False)):
        main._warn_placement(SequenceParallelConfig.parse({"strategy": "zigzag", "size": "dynamic",
                                                           "max_tokens_per_rank": 64, "ulysses_size": u}))
        err = capsys.readouterr().err
        assert ("sequence_parallel.ulysses_size=2 puts all-to-all groups across hosts" in err) == warned, err
