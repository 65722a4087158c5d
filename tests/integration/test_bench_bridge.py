"""The bridge benchmark's statistics: job order and paired ratios (bench/bridge.py)."""

from collections import Counter

import pytest

from conftest import load_bench_module


@pytest.fixture(scope="module")
def bridge():
    yield from load_bench_module("bridge")


def test_every_server_takes_every_position(bridge):
    servers = list("EPFLQ")
    for profile in range(6):
        positions = Counter()
        for rep in range(10):
            order = bridge.job_order(servers, rep, profile)
            assert sorted(order) == sorted(servers)
            positions.update((s, i) for i, s in enumerate(order))
        assert all(positions[(s, i)] == 2 for s in servers for i in range(5))


def test_no_server_always_follows_the_same_one(bridge):
    servers = list("EPFLQ")
    predecessors = {s: set() for s in servers}
    for rep in range(4):
        order = bridge.job_order(servers, rep, 0)
        for before, after in zip(order, order[1:]):
            predecessors[after].add(before)
    assert all(len(p) >= 2 for p in predecessors.values()), predecessors


def test_two_servers_alternate_which_runs_first(bridge):
    firsts = [bridge.job_order(["E", "P"], rep, 0)[0] for rep in range(6)]
    assert firsts == ["E", "P"] * 3


def sample(rep, mbps, ok=True):
    return {"repeat": rep, "mbps": mbps, "ok": ok}


def test_paired_ratio_is_the_median_of_same_repeat_ratios(bridge):
    # The machine slows over the run; in every repeat the numerator is 10 % behind.
    results = {"cpu": {
        "cb-enc": {"p": [sample(1, 90), sample(2, 45), sample(3, 27)]},
        "cb-pt": {"p": [sample(3, 30), sample(1, 100), sample(2, 50)]},
    }}
    ratio, pairs = bridge.paired_ratio(results, "cpu", "cb-enc", "cb-pt", "p")
    assert pairs == 3
    assert ratio == pytest.approx(0.9)


def test_paired_ratio_skips_failed_and_unpaired_jobs(bridge):
    results = {"cpu": {
        "cb-enc": {"p": [sample(1, 80), sample(2, 1, ok=False), sample(3, 60)]},
        "cb-pt": {"p": [sample(1, 100), sample(2, 100), sample(4, 100)]},
    }}
    ratio, pairs = bridge.paired_ratio(results, "cpu", "cb-enc", "cb-pt", "p")
    assert (ratio, pairs) == (pytest.approx(0.8), 1)
    assert bridge.paired_ratio(results, "cpu", "cb-enc", "nbdkit-file", "p") == (None, 0)


def test_tcp_servers_pair_with_their_own_transport(bridge):
    assert bridge.transport_of("cb-pt-tcp") == "tcp" and bridge.transport_of("nbdkit-file") == "unix"
    assert bridge.passthrough_of("cb-enc-tcp") == "cb-pt-tcp"
    assert bridge.passthrough_of("cb-enc") == "cb-pt"
    argv = bridge.cryptbridge_argv("cb-pt-tcp", "cb", "b.img", "k", "127.0.0.1:5555", 4096, [])
    assert argv[argv.index("--listen") + 1] == "127.0.0.1:5555" and "--unix" not in argv


def test_transport_ratio_compares_the_overhead_over_tcp_with_unix(bridge):
    # Per repeat: XTS/passthrough is 0.8 over TCP and 0.9 over unix -> 0.888...
    results = {"cpu": {
        "cb-enc-tcp": {"p": [sample(1, 80), sample(2, 40)]},
        "cb-pt-tcp": {"p": [sample(1, 100), sample(2, 50)]},
        "cb-enc": {"p": [sample(1, 90), sample(2, 45)]},
        "cb-pt": {"p": [sample(1, 100), sample(2, 50), sample(3, 70)]},
    }}
    ratio, pairs = bridge.transport_ratio(results, "cpu", ("cb-enc-tcp", "cb-pt-tcp"), ("cb-enc", "cb-pt"), "p")
    assert pairs == 2
    assert ratio == pytest.approx(0.8 / 0.9)
