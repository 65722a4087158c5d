"""CPU levels through the CLI: `--version` names the detected level, `CRYPTBRIDGE_CPU` forces a
lower one (or is refused with a clear message), and at every level the host supports the
`cipher` vector command matches the independent Python XTS reference and `bench cipher --json`
reports the level it ran at. Levels the host lacks are skipped with the reason."""
import json
import os
import random
import subprocess

import pytest

from conftest import assert_no_panic, random_key, require_binary
from reference import xts_ref

ALL_LEVELS = ["portable", "aesni", "vaes256", "vaes512"]


def cb_env(*args, level=None, input=None, timeout=120):
    env = dict(os.environ)
    env.pop("CRYPTBRIDGE_CPU", None)
    if level is not None:
        env["CRYPTBRIDGE_CPU"] = level
    p = subprocess.run([str(require_binary()), *args], input=input, capture_output=True, timeout=timeout, env=env)
    assert_no_panic(p.stderr.decode(errors="replace"))
    return p


def bench_json(level=None, cipher="xts(aes)", key_size=512):
    p = cb_env("bench", "cipher", "--cipher", cipher, "--key-size", str(key_size), "--threads", "1",
               "--seconds", "0.05", "--json", level=level)
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    return json.loads(p.stdout)


def supported_levels():
    return bench_json()["cpu_levels"]


def test_version_names_the_detected_level():
    p = cb_env("--version")
    assert p.returncode == 0
    out = p.stdout.decode()
    detected = bench_json()["cpu_detected"]
    assert f"CPU level {detected} detected" in out, out
    assert detected in ALL_LEVELS


def test_unknown_level_is_refused_with_the_known_names():
    p = cb_env("bench", "cipher", "--seconds", "0.05", level="avx9000")
    assert p.returncode == 2
    err = p.stderr.decode()
    assert "CRYPTBRIDGE_CPU=avx9000" in err and "vaes256" in err, err


def test_a_level_above_the_cpu_is_refused_naming_what_is_missing():
    supported = supported_levels()
    above = [level for level in ALL_LEVELS if level not in supported]
    if not above:
        pytest.skip("this CPU supports every x86 level; no level above it to ask for")
    p = cb_env("bench", "cipher", "--seconds", "0.05", level=above[-1])
    assert p.returncode == 2
    err = p.stderr.decode()
    assert "lacks" in err and above[-1] in err, err


@pytest.mark.parametrize("level", ALL_LEVELS)
def test_cipher_command_matches_reference_at_level(level):
    if level not in supported_levels():
        pytest.skip(f"this CPU lacks level {level}")
    rng = random.Random(0xC9 + ALL_LEVELS.index(level))
    jobs = []
    for i in range(120):
        key = random_key(rng.choice([32, 64]))
        length = rng.choice([16, 17, 31, 512, 520, 4096, 4100, rng.randint(16, 5000)])
        jobs.append((key, rng.randbytes(16), rng.randbytes(length)))
    lines = "".join(f"{k.hex()} {t.hex()} {d.hex()}\n" for k, t, d in jobs).encode()
    p = cb_env("cipher", "--cipher", "xts(aes)", level=level, input=lines)
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    out = p.stdout.decode().split()
    assert len(out) == len(jobs)
    for (key, tweak, data), got in zip(jobs, out):
        assert got == xts_ref.xts_encrypt(key, tweak, data).hex()


@pytest.mark.parametrize("level", ALL_LEVELS)
def test_bench_reports_the_level_it_ran_at(level):
    if level not in supported_levels():
        pytest.skip(f"this CPU lacks level {level}")
    r = bench_json(level)
    assert r["cpu_level"] == level
    assert r["encrypt_gbps"] > 0 and r["ecb_gbps"] > 0
    # AES-192 has no kernel of its own: it reports the portable path it runs on.
    assert bench_json(level, key_size=384)["cpu_level"] == "portable"
