"""The hub's commit budget (launcher/hub/commit_budget.py): a `sync:` that would commit past
an hf:// repo's budget is refused at launch in one line with the arithmetic; near it, or on
Ray, the arithmetic is a warning; `status` shows the commits of the last hour against it."""

from __future__ import annotations

import pytest

from launcher.cli import main as cli_main
from launcher.config.podconfig import SyncSettings
from launcher.hub.commit_budget import check_commit_budget, commit_plan
from launcher.hub.hub_rate import note_commit, note_wait
from tests.support.refusals import edit_config, pod, pod_template, refused  # noqa: F401

HF = "hf://owner/run"


def _sync(**values) -> SyncSettings:
    return SyncSettings.parse(values)


def test_launch_refuses_pushes_past_the_budget_with_the_arithmetic(pod, capsys):
    edit_config(pod, hub=HF, sync={"interval": 5})
    line = refused(pod, capsys)
    assert "one push every 5s = 3600/5 = 720 commits/hour" in line
    assert "above the budget of 128 commits/hour of hf://owner/run" in line
    assert "set sync.interval to 29 or more" in line
    # The fix it names fits: 3600/29 = 124 commits/hour.
    assert check_commit_budget(HF, _sync(interval=29), 8, False) is not None   # warned, run
    # A hub that takes more (sync.commits_per_hour) lets it run, warned: at 100% of it.
    assert "100% of the budget of 720" in check_commit_budget(
        HF, _sync(interval=5, commits_per_hour=720), 8, False)


@pytest.mark.parametrize("sync, words", [
    ({"interval": 0.1}, "sync.interval must be a duration from 1s"),
    ({"commits_per_hour": 0}, "sync.commits_per_hour must be an integer from 1 to 36000"),
    ({"commits_per_hour": 1e9}, "sync.commits_per_hour must be an integer from 1 to 36000"),
], ids=["interval-0.1", "budget-0", "budget-huge"])
def test_the_sync_numbers_have_a_range(pod, capsys, sync, words):
    edit_config(pod, sync=sync)
    assert words in refused(pod, capsys)


def test_near_the_budget_or_on_ray_the_arithmetic_is_a_warning():
    assert check_commit_budget(HF, _sync(interval=3600), 8, False) is None
    assert check_commit_budget("file://hub", _sync(interval=5), 8, False) is None   # no budget
    near = check_commit_budget(HF, _sync(interval=30), 8, False)
    assert "3600/30 = 120 commits/hour, 94% of the budget of 128" in near
    # On Ray the sync pushes no interval commits: the recovery copies take a quarter of the
    # budget, and the node pushes (a checkpoint and its manifest per pass) share the rest.
    ray = check_commit_budget(HF, _sync(interval=5), 8, True)
    assert "32 recovery-copy commits/hour" in ray and "passes one at most every 600s" in ray
    plan = commit_plan(_sync(), 8, True, recovery_per_hour=64)      # a caller's own rate
    assert plan.fixed_per_hour == 64 and plan.node_pass_every_s == 3600 * 2 * 8 / 64
    with pytest.raises(Exception, match="above the budget"):
        check_commit_budget(HF, _sync(), 8, True, recovery_per_hour=200)


def test_status_shows_commits_per_hour_and_the_rate_limiting(pod, capsys):
    edit_config(pod, hub=HF)
    for n in range(3):
        note_commit(pod, f"{n:040x}", HF)
    note_commit(pod, "d" * 40, "hf://datasets/owner/shards")     # another repo's budget
    assert cli_main(["--pod-dir", str(pod), "status"]) == 0
    out = capsys.readouterr().out
    assert "hub: 3 commits in the last hour (budget 128/hour)" in out
    note_wait(pod, "committing", 30.0, 30.0, push="p1")
    assert cli_main(["--pod-dir", str(pod), "status", "--wide"]) == 0
    out = capsys.readouterr().out
    assert "hub: RATE-LIMITED since " in out and "1 wait, 1 push delayed" in out
