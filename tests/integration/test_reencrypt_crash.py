"""Short reencryption crash campaigns (reencrypt_crash.py, issue 28): `serve --reencrypt` (and
`cryptsetup reencrypt`) killed with SIGKILL while a client writes, in and out of hotzones, with and
without the power-loss model; recovered by cryptbridge or by cryptsetup; every byte and every
acknowledged write checked. `make crash-campaign-reencrypt` runs the full 30 rounds per mode.
Here: 5 rounds per mode (resilience checksum, journal, datashift, and the decryption whose header
moves out, datashift-checksum), and the negative control, which
the campaign must catch. REENCRYPT_CRASH_SEED=N repeats a run's random choices.
"""
from __future__ import annotations

import os

import pytest

import reencrypt_crash as rc


def campaign(tmp_path, rounds, **kw):
    reason = rc.skip_reason()
    if reason:
        pytest.skip(reason)
    seed = int(os.environ["REENCRYPT_CRASH_SEED"]) if "REENCRYPT_CRASH_SEED" in os.environ else None
    lines: list[str] = []

    def log(msg):
        print(msg)
        lines.append(msg)

    results, summary = rc.run_campaign(rounds, tmp_path, seed, log=log, **kw)
    return results, summary, "\n".join(lines) + f"\nsummary: {summary}"


def test_kill_9_and_power_loss_rounds_lose_nothing(tmp_path):
    results, summary, report = campaign(tmp_path, 5, power_loss=True, modes=("checksum", "journal", "datashift", "decrypt"))
    assert len(results) == 20, report
    for r in results:
        assert r.ok, f"round {r.round} {r.resilience}: {r.wrong + r.problems}\n{report}"
    # Not vacuous: kills in hotzones, hotzones recovered, cryptsetup on both sides, writes acknowledged and undone.
    total = {k: sum(m[k] for m in summary["per_mode"].values()) for k in next(iter(summary["per_mode"].values()))}
    assert total["killed_in_hotzone"] > 0 and total["hotzones_recovered"] > 0, report
    assert total["recovered_by_cryptsetup"] > 0 and total["cryptsetup_killed"] > 0, report
    assert summary["acked_writes"] > 0 and summary["power_loss_rounds"] > 0, report


def test_the_campaign_catches_syncs_that_do_nothing(tmp_path):
    """Negative control: the undo shim counts no sync, so every write of the round is undone after
    the kill, acknowledged ones included: the campaign must report them."""
    results, _, report = campaign(tmp_path, 1, lie=True, modes=("checksum",))
    (r,) = results
    assert r.acked_writes > 0 and r.writes_undone > 0, report
    assert r.wrong, f"every write was undone, yet nothing was reported wrong\n{report}"
