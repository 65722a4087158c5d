"""bench/vhost.py keeps running: a --quick run with tiny jobs gives every server and profile a row
and every ratio, and the pure parts pair jobs by repeat."""

import json
import shutil
import subprocess
import sys

import pytest

from conftest import BIN, REPO, Bridge, assert_no_panic, example_binary, load_bench_module

@pytest.fixture(scope="module")
def vhost():
    yield from load_bench_module("vhost")


def sample(rep, mbps, cpu=1.0, ok=True):
    return {"repeat": rep, "mbps": mbps, "server_cpu_s_per_gib": cpu, "ok": ok}


def test_ratios_pair_jobs_of_the_same_repeat(vhost):
    results = {
        "vhost-enc": {"rnd4k_q32t1_read": [sample(1, 300, 0.5), sample(2, 150, 0.5), sample(3, 1, ok=False)]},
        "nbd-enc": {"rnd4k_q32t1_read": [sample(2, 100, 1.0), sample(1, 200, 1.0), sample(3, 100)]},
    }
    assert vhost.paired(results, "vhost-enc", "nbd-enc", "rnd4k_q32t1_read", "mbps") == (pytest.approx(1.5), 2)
    rows = {(r["ratio"], r["pkey"]): r for r in vhost.compute_ratios(results)}
    assert rows[("XTS: vhost / NBD MB/s", "rnd4k_q32t1_read")]["verdict"] == "PASS"
    assert rows[("XTS: vhost / NBD CPU s/GiB", "rnd4k_q32t1_read")]["verdict"] == "PASS"  # 0.5 <= 0.6
    assert rows[("vhost: XTS / passthrough MB/s", "seq1m_q8t1_read")]["value"] is None


def test_front_ends_alternate_in_every_order(vhost):
    for rep in range(4):
        for pi in range(len(vhost.PROFILES)):
            order = vhost.job_order(vhost.SERVERS, rep, pi)
            fronts = [k.split("-")[0] for k in order]
            assert all(a != b for a, b in zip(fronts, fronts[1:])), order


@pytest.mark.parametrize("poll", [False, True], ids=["interrupt", "poll"])
def test_bench_client_completes_every_request_in_both_wait_modes(ws, poll):
    """vhost_blk_bench waits on its completion eventfd, or with --poll spins on libblkio's poll
    queues, which ask the device for no used-ring notifications (bench/vhost.py --client-poll): the
    bridge must complete every request either way, for a client and for the next one on the socket."""
    if not BIN.exists():
        pytest.skip(f"{BIN} not built")
    bench = example_binary("vhost_blk_bench", "CRYPTBRIDGE_VHOST_BENCH")
    key_file, _ = ws.key(64)
    sock = ws.sockdir / "vb.sock"
    b = Bridge(ws.tmp, ["--backing", ws.backing(8 << 20), "--key-file", key_file, "--sector-size", 4096,
                        "--vhost-user-blk", sock], label="vhost-bench")
    ws.bridges.append(b)
    b.start()
    args = [bench, sock, "--rw", "randrw", "--bs", "4k", "--iodepth", "16", "--runtime", "0.5", "--ramp", "0"]
    for _ in range(2):
        p = subprocess.run([*map(str, args), *(["--poll"] if poll else [])], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stdout + p.stderr
        out = json.loads(p.stdout)
        assert out["ok"] and out["errors"] == 0 and out["poll"] is poll, out
        assert out["read_bytes"] > 0 and out["write_bytes"] > 0, out
    assert b.alive
    assert_no_panic(b.stderr(), "serve --vhost-user-blk")


@pytest.mark.slow
def test_quick_run_reports_every_row(tmp_path):
    if not BIN.exists():
        pytest.skip(f"{BIN} not built")
    if shutil.which("fio") is None:
        pytest.skip("fio is not installed")
    if "uri" not in subprocess.run(["fio", "--enghelp=nbd"], capture_output=True, text=True, timeout=30).stdout:
        pytest.skip("fio has no nbd engine")
    client = example_binary("vhost_blk_bench", "CRYPTBRIDGE_VHOST_BENCH")
    out = tmp_path / "vhost.json"
    r = subprocess.run(
        [sys.executable, REPO / "bench" / "vhost.py", "--quick", "--runtime", "0.3", "--ramp", "0.1", "--size", "32M",
         "--binary", BIN, "--client", client, "--workdir", tmp_path, "--out-json", out, "--out-md", tmp_path / "vhost.md"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    data = json.loads(out.read_text())
    for key in ("vhost-enc", "nbd-enc", "vhost-pt", "nbd-pt"):
        for pkey in ("seq1m_q8t1_read", "seq1m_q8t1_write", "rnd4k_q32t1_read", "rnd4k_q32t1_write"):
            s = data["summary"][key][pkey]
            assert s["n"] == 1 and s["mbps"] > 0 and s["server_cpu_s_per_gib"] is not None, (key, pkey, s)
    verdicts = [r["verdict"] for r in data["ratios"] if r["target"] is not None]
    assert len(verdicts) == 6 and set(verdicts) <= {"PASS", "MISS"}, data["ratios"]
    assert "vhost-user XTS" in (tmp_path / "vhost.md").read_text()
