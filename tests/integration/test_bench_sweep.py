"""The device sweep's arguments, order and statistics (bench/device_sweep.py)."""

import pytest

from conftest import load_bench_module


@pytest.fixture(scope="module")
def sweep():
    yield from load_bench_module("device_sweep")


def test_caps_parse_numbers_and_none(sweep):
    assert sweep.parse_caps("600, 1500,none") == [600, 1500, None]
    assert sweep.parse_caps("Unthrottled") == [None]


@pytest.mark.parametrize("bad", ["", " , ", "0", "-5", "fast"])
def test_bad_caps_are_refused(sweep, bad):
    with pytest.raises(ValueError):
        sweep.parse_caps(bad)


def test_every_cap_leads_one_repeat_in_turn(sweep):
    caps = [600, 1000, None]
    firsts = [sweep.cap_order(caps, rep)[0] for rep in range(3)]
    assert sorted(firsts, key=str) == sorted(caps, key=str)
    assert all(sorted(sweep.cap_order(caps, rep), key=str) == sorted(caps, key=str) for rep in range(5))


def test_pair_order_alternates(sweep):
    assert sweep.pair_order(["E", "P"], 0) == ["E", "P"]
    assert sweep.pair_order(["E", "P"], 1) == ["P", "E"]


def test_summary_pairs_same_repeat_and_skips_failures(sweep):
    seq_write = next(p for p in sweep.bridge.PROFILES if p.key == "seq1m_q8t1_write")

    def sample(rep, mbps, ok=True, busy=0.5):
        return {"repeat": rep, "mbps": mbps, "ok": ok, "machine_busy": busy}

    results = {"600": {
        "cb-enc": {seq_write.key: [sample(1, 500), sample(2, 900), sample(3, 100, ok=False), sample(4, 800)]},
        "cb-pt": {seq_write.key: [sample(1, 1000), sample(2, 1000), sample(3, 1000), sample(5, 700)]},
    }}
    [row] = sweep.summarize(results, [600], [seq_write])
    # Pairs: repeat 1 -> 0.5, repeat 2 -> 0.9; repeat 3's encrypted job failed, 4 and 5 are unpaired.
    assert row["pairs"] == 2
    assert row["ratio"] == pytest.approx(0.7)
    assert row["enc_mbps"] == 800  # median of 500, 900, 800
    assert row["pt_mbps"] == 1000
    assert row["cap_read_mbps"] == 880
    assert row["verdict"] == "MISS"
