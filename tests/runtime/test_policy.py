"""The build and give-up rules on sites made of plain counts (runtime/policy.py): each rule at
the edge where it starts to apply."""
from types import SimpleNamespace

from terra.runtime import policy


def _path(count=1, hits=0, graph=None, first_seen=1, last_seen=None, late=False, group=None,
          first_hit=None):
    """A path seen `count` times; with a graph, built at its `count`-th sighting."""
    return SimpleNamespace(count=count, hits=hits, graph=graph, first_seen=first_seen,
                           last_seen=first_seen if last_seen is None else last_seen, late=late,
                           group=group, built_count=count if graph is not None else 0,
                           first_hit=first_hit)


def _site(*paths, builds=0, fallbacks=0, known_fallbacks=0):
    return SimpleNamespace(paths={i: p for i, p in enumerate(paths)}, builds=builds,
                           fallbacks=fallbacks, known_fallbacks=known_fallbacks)


GRAPH = object()


def test_a_site_without_a_graph_builds_at_the_second_sighting():
    first, second = _path(count=1), _path(count=2, last_seen=40)
    site = _site(first, second)
    assert not policy.due(site, first, 40)
    assert policy.due(site, second, 40)   # however far apart: the site's first graph


def test_a_compiled_site_builds_at_first_sight_until_two_such_graphs_stay_unused():
    common = _path(count=10, hits=8, graph=GRAPH)
    once_a = _path(graph=GRAPH, first_seen=5)
    once_b = _path(graph=GRAPH, first_seen=6)
    new = _path(first_seen=8)
    site = _site(common, once_a, once_b, new)
    # at iteration 7 only once_a is 2 iterations old: one unused graph
    assert policy.unused_once(site, 7) == 1 and policy.due(site, new, 7)
    assert policy.unused_once(site, 8) == 2 and not policy.due(site, new, 8)
    once_b.hits, once_b.first_hit = 1, 8   # served 2 iterations after its first sighting
    assert policy.due(site, new, 8)
    once_b.first_hit = 15                  # served, but 9 iterations on: a bad bet all the same
    assert policy.unused_once(site, 16) == 2 and not policy.due(site, new, 16)
    once_b.first_hit = 14                  # 8 on
    assert policy.unused_once(site, 16) == 1


def test_past_the_first_sight_budget_frequent_paths_build_at_the_second_sighting():
    site = _site(_path(count=10, hits=8, graph=GRAPH), _path(graph=GRAPH, first_seen=1),
                 _path(graph=GRAPH, first_seen=2))
    assert not policy.due(site, _path(count=1, first_seen=20), 20)
    assert policy.due(site, _path(count=2, first_seen=20, last_seen=28), 28)      # 8 apart
    assert not policy.due(site, _path(count=2, first_seen=20, last_seen=29), 29)  # 9 apart
    assert policy.due(site, _path(count=3, first_seen=20, last_seen=36), 36)      # 8 on average
    assert not policy.due(site, _path(count=4, first_seen=20, last_seen=80), 80)
    assert policy.due(site, _path(count=5, first_seen=20, last_seen=200), 200)    # rare: fifth


def _tally(site, max_traces=8, max_fallbacks=20):
    return policy.Tally.of(site, max_traces, max_fallbacks)


def test_a_site_gives_up_at_four_late_paths_seen_once_only_while_no_graph_served():
    late = [_path(late=True) for _ in range(4)]
    site = _site(_path(count=2, graph=GRAPH), *late, builds=5)
    assert policy.give_up(_tally(site)) == (
        "churn", "5 graph builds and 4 paths seen once since it compiled served no compiled "
                 "iteration: its paths keep changing")
    site.paths[0].hits = 1
    assert policy.give_up(_tally(site)) is None
    site.paths[0].hits, late[0].count = 0, 2
    assert policy.give_up(_tally(site)) is None


def test_the_build_limit_holds_while_builds_are_not_outnumbered_by_served_iterations():
    served = _path(count=20, hits=15, graph=GRAPH)
    site = _site(served, builds=16)
    assert policy.give_up(_tally(site)) == (
        "builds", "16 graph builds, the limit of 2 x max_traces, for 15 compiled iterations: "
                  "its paths keep changing")
    served.hits = 16
    assert policy.give_up(_tally(site)) is None
    site.builds = 17
    assert policy.give_up(_tally(site))[0] == "builds"
    site.builds = 5
    assert policy.give_up(_tally(site, max_traces=3)) is None
    site.builds, served.hits = 6, 2
    assert policy.give_up(_tally(site, max_traces=3))[0] == "builds"


def test_max_fallbacks_counts_only_unknown_fallbacks_and_yields_to_served_iterations():
    served = _path(count=30, hits=25, graph=GRAPH)
    site = _site(served, builds=1, fallbacks=24, known_fallbacks=4)
    assert policy.give_up(_tally(site)) is None          # 20 held, 25 served
    served.hits = 20
    assert policy.give_up(_tally(site)) == ("fallbacks", "20 fallbacks")
    served.hits = 3
    site.known_fallbacks = 5
    assert policy.give_up(_tally(site)) is None          # 19 held


def test_shape_members_traced_once_give_up_only_while_no_graph_served():
    group = SimpleNamespace(speculative=False)
    members = [_path(group=group) for _ in range(8)]
    site = _site(_path(count=2, graph=GRAPH), *members, builds=1)
    assert policy.give_up(_tally(site)) == (
        "shapes", "8 shapes traced once each on a shape group's graph served no compiled "
                  "iteration: its paths keep changing")
    members[0].hits = 1
    assert policy.give_up(_tally(site)) is None


def test_a_speculative_groups_one_member_counts_as_a_path_of_its_own():
    # a group of one (shape_groups.speculate) is a bet on a path graph, not a shape served
    spec = [_path(late=True, group=SimpleNamespace(speculative=True)) for _ in range(4)]
    site = _site(_path(count=2, graph=GRAPH), *spec, builds=1)
    assert policy.late_once(site) == 4
    assert _tally(site).unused_members == 0
    for p in spec:
        p.group.speculative = False
    assert policy.late_once(site) == 0
    assert _tally(site).unused_members == 4


def test_the_first_rule_that_fires_names_the_verdict():
    late = [_path(late=True) for _ in range(4)]
    site = _site(_path(count=2, graph=GRAPH), *late, builds=16, fallbacks=20)
    assert [r.name for r in policy.GIVE_UP] == ["churn", "shapes", "builds", "fallbacks"]
    assert policy.give_up(_tally(site))[0] == "churn"


def test_a_site_takes_a_site_graph_once_read_restarts_cost_a_build():
    n, f = policy.READ_RESTARTS, policy.SITE_BUILD_FACTOR
    assert (n, f) == (3, 2.0)
    assert policy.takes_site_graph(n, f * 0.5, 0.5)          # waited as long as it costs
    assert not policy.takes_site_graph(n, f * 0.5 - 1e-3, 0.5)
    assert not policy.takes_site_graph(n - 1, 100.0, 0.5)    # too few restarts to be a pattern
    assert policy.takes_site_graph(n + 10, 100.0, 0.5)


def test_a_site_graph_is_rebuilt_once_restarts_outside_it_cost_a_rebuild():
    n, f = policy.READ_RESTARTS, policy.SITE_REBUILD_FACTOR
    assert f == 1.5
    assert policy.rebuilds_site_graph(n, f * 2.0, 2.0)       # priced at the last lowering
    assert not policy.rebuilds_site_graph(n, f * 2.0 - 1e-3, 2.0)
    assert not policy.rebuilds_site_graph(n - 1, 100.0, 2.0)
    assert policy.rebuilds_site_graph(n + 5, 100.0, 2.0)
