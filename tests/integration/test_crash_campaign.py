"""Short crash campaigns (crash_campaign.py): the server is killed (SIGKILL) under an ext4 workload
over nbdfuse + loop; after a restart, ext4 replays its journal, every fsync'd file's sha256 is
checked and `fsck.ext4 -fn` must exit 0.

`make crash-campaign` runs the full 20 rounds. Here: one kill -9 round per volume kind (4096-byte
sectors with 4 KiB ext4 blocks, 512-byte sectors with 4 KiB and with 1 KiB blocks) plus a
`--direct` round; three power-loss rounds (writes no completed fdatasync covered are undone after
the kill); and the negative control, a server whose syncs count for nothing, which the campaign
must catch. CRASH_CAMPAIGN_SEED=N repeats a run's random choices (kill delays, operations).
"""
from __future__ import annotations

import os
import shutil

import pytest

import crash_campaign as cc


def _campaign(tmp_path, rounds, **kw):
    reason = cc.skip_reason(tmp_path)
    if reason:
        pytest.skip(reason)
    seed = int(os.environ["CRASH_CAMPAIGN_SEED"]) if "CRASH_CAMPAIGN_SEED" in os.environ else None
    workdir = tmp_path / "campaign"
    workdir.mkdir()
    lines: list[str] = []

    def log(msg):
        print(msg)
        lines.append(msg)

    results, summary, leftovers = cc.run_campaign(rounds, workdir, seed, log=log, **kw)
    report = "\n".join(lines) + f"\nsummary: {summary}"
    assert not leftovers, f"left behind: {leftovers}\n{report}"
    assert len(results) == rounds, report
    return results, summary, report, workdir


def _assert_all_clean(results, summary, report):
    for r in results:
        assert not r.problems, f"round {r.round}: {r.problems}\n{report}"
        assert not r.lost, f"round {r.round}: fsync'd files lost or changed: {r.lost}\n{report}"
        assert r.fsck_rc == 0, f"round {r.round}: fsck.ext4 -fn exit {r.fsck_rc}:\n{r.fsck_out}\n{report}"
    # not vacuous: fsync'd work was done before the kills, the kills left a journal to replay, and
    # the files were checked
    assert summary["fsynced_steps_before_kill_total"] > 0, report
    assert summary["files_verified_total"] > 0, report
    assert summary["rounds_needing_journal_replay"] > 0, report


@pytest.mark.root
@pytest.mark.slow
def test_kill9_rounds(tmp_path):
    results, summary, report, workdir = _campaign(tmp_path, 4, delay=(0.3, 2.5))
    assert [r.volume for r in results] == ["s4096-b4096", "s512-b4096", "s512-b1024", "s4096-b4096"]
    assert [r.direct for r in results] == [False, False, False, True]
    _assert_all_clean(results, summary, report)
    shutil.rmtree(workdir, ignore_errors=True)  # the backing images


@pytest.mark.root
@pytest.mark.slow
def test_power_loss_rounds(tmp_path):
    results, summary, report, workdir = _campaign(tmp_path, 3, delay=(0.5, 2.5), power_loss=True)
    assert all(r.crash_model.startswith("power-loss") for r in results)
    _assert_all_clean(results, summary, report)
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.root
@pytest.mark.slow
def test_campaign_catches_a_server_whose_syncs_do_nothing(tmp_path):
    """Negative control: the undo shim counts no fdatasync, so after the kill the backing loses
    everything the round wrote. The checker must report the fsync'd files as lost."""
    results, summary, report, workdir = _campaign(tmp_path, 1, delay=(1.0, 1.5), lie=True, block_sizes=(4096,))
    (r,) = results
    assert not r.problems, report
    assert r.steps_done_at_kill > 0, f"the workload finished no fsync'd step in 1 s: nothing to lose\n{report}"
    assert r.writes_undone > 0, report
    assert r.lost, f"every write of the round was undone, yet no fsync'd file was reported lost\n{report}"
    shutil.rmtree(workdir, ignore_errors=True)
