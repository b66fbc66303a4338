"""The local tier's pure decisions: nodes, copy placement, space, recoverable steps, sources."""

from __future__ import annotations

import os

import pytest

from dcpbridge.engine.collectives import Group
from dcpbridge.engine.local_plan import (
    Extent,
    LocalStep,
    Nodes,
    choose_sources,
    copy_targets,
    lacking_space,
    merge_extents,
    newest_recoverable,
    node_needs,
    second_try_avoid,
    transfers,
)
from dcpbridge.engine.local_tier import LocalTier
from dcpbridge.errors import InvalidArgumentError

DOC = "dcpbridge.json"


def test_nodes_cut_ranks_into_consecutive_groups():
    nodes = Nodes(5, 2)
    assert nodes.count == 3
    assert [nodes.node_of(r) for r in range(5)] == [0, 0, 1, 1, 2]
    assert list(nodes.ranks_of(2)) == [4]
    assert nodes.lead(1) == 2
    with pytest.raises(InvalidArgumentError):
        Nodes(4, 0)


def test_copies_go_to_other_nodes_at_the_same_place():
    nodes = Nodes(8, 2)
    assert copy_targets(0, nodes, 1) == [2]
    assert copy_targets(3, nodes, 2) == [5, 7]
    assert copy_targets(7, nodes, 1) == [1]  # wraps around
    for rank in range(8):
        homes = {nodes.node_of(t) for t in copy_targets(rank, nodes, 3)}
        assert nodes.node_of(rank) not in homes and len(homes) == 3


def test_copies_are_capped_by_the_other_nodes_and_fit_a_smaller_last_node():
    assert copy_targets(0, Nodes(2, 2), 3) == []  # one node: nowhere to copy
    nodes = Nodes(5, 2)  # nodes {0,1} {2,3} {4}
    assert copy_targets(1, nodes, 2) == [3, 4]
    assert copy_targets(4, nodes, 1) == [0]


def test_each_rank_receives_as_many_copies_as_it_sends_when_nodes_are_even():
    nodes = Nodes(12, 4)
    received = [0] * 12
    for rank in range(12):
        for t in copy_targets(rank, nodes, 2):
            received[t] += 1
    assert received == [2] * 12


def test_space_need_counts_own_parts_and_copies():
    nodes = Nodes(4, 2)
    assert node_needs([10, 20, 30, 40], nodes, 1) == [30 + 70, 70 + 30]
    assert lacking_space([10, 20, 30, 40], [1000, 1000, 99, 99], nodes, 1) == {1: (99, 100)}
    assert lacking_space([10, 20, 30, 40], [None] * 4, nodes, 1) == {}


def _step(step, files, held, save_id="a", digest="d"):
    return LocalStep(step, save_id, digest, len(files), {n: 1 for n in held})


def test_newest_recoverable_needs_every_file_somewhere():
    files = ["f0", "f1", "f2", "f3"]
    node0 = [_step(4, files, [DOC, "f0", "f1", "f2", "f3"]), _step(6, files, [DOC, "f0", "f1"])]
    node1 = [_step(6, files, [DOC, "f2"])]  # f3 of step 6 is gone everywhere
    chosen = newest_recoverable([node0, node0, node1, node1], DOC)
    assert chosen is not None and chosen.step == 4
    node1 = [_step(6, files, [DOC, "f2", "f3"])]
    chosen = newest_recoverable([node0, node0, node1, node1], DOC)
    assert chosen is not None and chosen.step == 6
    assert chosen.holders["f3"] == [2, 3] and chosen.holders[DOC] == [0, 1, 2, 3]
    assert chosen.sizes[("f3", 2)] == 1 and ("f3", 0) not in chosen.sizes
    assert len(chosen.sizes) == 4 * 3  # step 6: the document and two data files per rank
    assert newest_recoverable([node0, node0, node1, node1], DOC, after=7) is None
    assert newest_recoverable([node0, node0, node1, node1], DOC, step=4).step == 4


def test_a_step_without_its_document_anywhere_is_not_recoverable():
    assert newest_recoverable([[_step(2, ["f0"], ["f0"])]], DOC) is None


def test_two_saves_of_one_step_never_mix():
    a = _step(5, ["fa"], [DOC, "fa"], save_id="a", digest="x")
    b = _step(5, ["fb"], ["fb"], save_id="b", digest="y")
    chosen = newest_recoverable([[a], [b]], DOC)
    assert chosen is not None and (chosen.save_id, chosen.holders) == ("a", {DOC: [0], "fa": [0]})


def test_a_report_whose_files_disagree_with_its_digest_is_ignored():
    good = _step(3, ["f0", "f1"], [DOC, "f0"])
    liar = _step(3, ["f0"], [DOC, "f0", "f1"])  # same digest, other file list
    assert newest_recoverable([[good], [liar]], DOC) is None


def test_sources_prefer_the_own_node_and_spread_over_holders():
    files = ["f0", "f1", "f2", "f3"]
    report = [[_step(1, files, [DOC, *files])]] * 2 + [[_step(1, files, [DOC])]] * 2
    chosen = newest_recoverable(report, DOC)
    assert choose_sources(files, 0, chosen) == dict.fromkeys(files, 0)
    got = choose_sources(files, 2, chosen)
    assert set(got.values()) == {0, 1}  # both holders serve
    assert got == choose_sources(files, 2, chosen)  # deterministic


def test_extents_merge_when_close_and_transfers_turn_requests_around():
    merged = merge_extents([Extent("a", 0, 10), Extent("a", 64, 10), Extent("a", 10_000, 5)])
    assert merged == [Extent("a", 0, 74), Extent("a", 10_000, 5)]
    assert merge_extents([Extent("a", 0, 10), Extent("b", 10, 10)]) == [
        Extent("a", 0, 10),
        Extent("b", 10, 10),
    ]
    requests = [{}, {0: [Extent("a", 0, 1)]}, {0: [Extent("b", 0, 2)], 2: [Extent("c", 0, 1)]}]
    assert transfers(requests) == {0: {1: [Extent("a", 0, 1)], 2: [Extent("b", 0, 2)]}}


def test_a_second_try_reads_other_nodes_copies_where_there_are_some():
    files = ["f0", "f1"]
    report = [[_step(1, files, [DOC, *files])]] * 2 + [[_step(1, files, [DOC, "f0"])]] * 2
    chosen = newest_recoverable(report, DOC)
    nodes = Nodes(4, 2)
    first = choose_sources(files, 0, chosen)
    assert first == {"f0": 0, "f1": 0}
    got = choose_sources(files, 0, chosen, avoid=second_try_avoid(first, nodes))
    assert got["f0"] in (2, 3) and got["f1"] == 0  # f1 has no copy elsewhere
    first = choose_sources(files, 2, chosen)
    assert first["f0"] == 2 and first["f1"] in (0, 1)  # f1 came from node 0 the first time
    again = choose_sources(files, 2, chosen, avoid=second_try_avoid(first, nodes))
    assert again == {"f0": 0, "f1": first["f1"]}  # f0 from node 0; f1: node 0 is its only one
    assert second_try_avoid({"f0": 3, "f1": 0}, nodes) == {"f0": range(2, 4), "f1": range(0, 2)}


@pytest.mark.parametrize(
    ("cores", "ranks_per_node", "threads"),
    [(2, 2, 1), (2, 8, 1), (12, 4, 3), (16, 2, 4), (96, 8, 4)],
)
def test_a_local_restore_reads_with_at_most_the_cores_per_rank(
    monkeypatch, tmp_path, cores, ranks_per_node, threads
):
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    tier = LocalTier(
        str(tmp_path), Group(None, 0, 1, 0), replicas=0, ranks_per_node=ranks_per_node, run="r"
    )
    assert tier.reader_threads == threads
