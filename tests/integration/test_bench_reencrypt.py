"""bench/reencrypt.py keeps running: a --quick run with tiny images gives every tool and mode a
row and every target a verdict, and the pure parts pair runs by repeat."""

import json
import subprocess
import sys

import pytest

from conftest import BIN, REPO, load_bench_module
from test_luks import tool


@pytest.fixture(scope="module")
def reenc():
    yield from load_bench_module("reencrypt")


def test_ratios_pair_runs_of_the_same_repeat(reenc):
    samples = [
        {"tool": "cryptsetup", "repeat": 1, "ok": True, "mbps": 100.0},
        {"tool": "cb-offline", "repeat": 1, "ok": True, "mbps": 300.0},
        {"tool": "cryptsetup", "repeat": 2, "ok": True, "mbps": 50.0},
        {"tool": "cb-offline", "repeat": 2, "ok": True, "mbps": 50.0},
        {"tool": "cryptsetup", "repeat": 3, "ok": False},
        {"tool": "cb-offline", "repeat": 3, "ok": True, "mbps": 400.0},
    ]
    assert reenc.paired(samples, "cb-offline", "cryptsetup") == (pytest.approx(2.0), 2)


def test_online_jobs_after_the_reencryption_ended_are_left_out(reenc):
    state = {"offline": {}, "online": {"rnd4k_q32t1_read": [
        {"tool": "baseline", "repeat": 1, "ok": True, "mbps": 100.0, "iops": 1},
        {"tool": "online", "repeat": 1, "ok": True, "mbps": 90.0, "iops": 1, "reencrypting_at_end": True},
        {"tool": "baseline", "repeat": 2, "ok": True, "mbps": 100.0, "iops": 1},
        {"tool": "online", "repeat": 2, "ok": True, "mbps": 10.0, "iops": 1, "reencrypting_at_end": False},
    ]}}
    row = {r["pkey"]: r for r in reenc.compute(state)["online"]}["rnd4k_q32t1_read"]
    assert row["ratio"] == pytest.approx(0.9) and row["pairs"] == 1 and row["verdict"] == "PASS"
    assert row["not_running_at_end"] == 1


@pytest.mark.slow
def test_quick_run_reports_every_row(tmp_path):
    if not BIN.exists():
        pytest.skip(f"{BIN} not built")
    if tool("cryptsetup") is None:
        pytest.skip("cryptsetup is not installed")
    if tool("fio") is None:
        pytest.skip("fio is not installed")
    if "uri" not in subprocess.run(["fio", "--enghelp=nbd"], capture_output=True, text=True, timeout=30).stdout:
        pytest.skip("fio has no nbd engine")
    out = tmp_path / "reencrypt.json"
    r = subprocess.run(
        [sys.executable, REPO / "bench" / "reencrypt.py", "--quick", "--binary", BIN, "--workdir", tmp_path,
         "--out-json", out, "--out-md", tmp_path / "reencrypt.md"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    data = json.loads(out.read_text())
    rows = {row["resilience"]: row for row in data["computed"]["offline"]}
    assert set(rows) == {"checksum", "journal", "none"}
    for mode, row in rows.items():
        for t in ("cryptsetup", "cb-offline", "cb-idle"):
            assert row[t]["n"] == 1 and row[t]["mbps"] > 0 and row[t]["cpu_s"] is not None, (mode, t, row[t])
        assert row["offline_verdict"] in ("PASS", "MISS") and row["idle_verdict"] in ("PASS", "MISS"), row
    for row in data["computed"]["online"]:
        assert row["baseline"]["n"] + row["online"]["n"] >= 1, row
    assert len(data["verdicts"]) >= 6, data["verdicts"]
    assert "cryptsetup reencrypt" in (tmp_path / "reencrypt.md").read_text()
