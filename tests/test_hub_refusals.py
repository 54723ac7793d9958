"""Hub commands' refusals (issue 16, items 14, 19, 21): a store, revision or folder that is
not there is the user's to fix (exit 2, one line naming it); a pull that refuses a file
installs none of them; a failing hub call says one line, its retries go to logs/hub.log.

Real files, a real file:// store and the real CLI (in-process `main`)."""

from __future__ import annotations

from pathlib import Path

from launcher.hub import open_store
from tests.support.hub_pod import CKPT, MANIFEST, add_passed, pod, run  # noqa: F401 (fixture)


def one_error(code: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    return lines[0]


def test_an_unknown_revision_is_exit_2_and_says_where_the_revisions_are(pod, capsys):
    add_passed(pod, 0, 100)
    assert run(capsys, pod, "sync", "push")[0] == 0
    code, _, err = run(capsys, pod, "sync", "pull", "--revision", "zzz")
    line = one_error(code, err)
    assert "unknown revision 'zzz'" in line and "sync history" in line


def test_a_missing_store_is_exit_2_naming_its_path(pod, tmp_path, capsys, monkeypatch):
    """From the wrong folder, a relative file:// names no store: it used to say "has no
    revisions yet" and exit 1."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, _, err = run(capsys, tmp_path / "new", "sync", "pull", "--from", "file://hub")
    line = one_error(code, err)
    assert f"no hub store at {elsewhere / 'hub'}" in line and "has no revisions" not in line
    assert not (tmp_path / "new").exists()
    # An existing but empty store still says so, with the fix.
    code, _, err = run(capsys, pod, "sync", "pull")
    assert "no hub store" in one_error(code, err)


def test_a_pull_that_refuses_a_checkpoint_installs_nothing(pod, tmp_path, capsys):
    """The manifest used to land in NEW before the corrupt checkpoint it names was
    refused: NEW then held a manifest naming a missing file."""
    add_passed(pod, 0, 100)
    code, out, err = run(capsys, pod, "sync", "push")
    assert code == 0, err
    store = open_store("file://hub", pod)
    entry = store.files()[CKPT.format(0)]
    obj = pod / "hub" / "objects" / entry.sha256[:2] / entry.sha256
    obj.chmod(0o644)
    obj.write_bytes(b"corrupt" + obj.read_bytes()[7:])
    new = tmp_path / "new"
    code, _, err = run(capsys, new, "sync", "pull", "--from", f"file://{pod / 'hub'}")
    assert code == 1 and err.startswith("error: ") and CKPT.format(0) in err, err
    assert not new.exists(), sorted(p.name for p in new.rglob("*"))
    # Into an existing folder: nothing of the revision lands either.
    new.mkdir()
    code, _, err = run(capsys, new, "sync", "pull", "--from", f"file://{pod / 'hub'}")
    assert code == 1 and sorted(new.rglob("*")) == []


def test_the_live_manifest_refusal_reads_as_english(pod, capsys):
    add_passed(pod, 0, 100)
    code, out, _ = run(capsys, pod, "sync", "push")
    old_rev = out.split("pushed revision ")[1].split()[0]
    add_passed(pod, 0, 200)
    code, _, err = run(capsys, pod, "sync", "pull", "--revision", old_rev, MANIFEST)
    line = one_error(code, err)
    assert f"refusing to overwrite {MANIFEST}, the pod's manifest, with other bytes" in line
    assert "in the manifest in the manifest" not in line
    code, _, err = run(capsys, pod, "sync", "pull", "--revision", old_rev, CKPT.format(0))
    assert "GPU 0's resume point (token 200) in the manifest, with other" in one_error(code, err)


def test_a_failing_hub_call_is_one_line_and_its_retries_are_in_the_log(tmp_path, capsys):
    from launcher.cli.options import log_hub_retries
    from launcher.hub.retry import RetryPolicy, with_retries
    log_hub_retries(tmp_path)
    calls = []

    def push():
        calls.append(1)
        raise ConnectionError("hub unreachable")

    try:
        with_retries(push, "push", RetryPolicy(attempts=6, base_delay_s=0), sleep=lambda s: None)
    except ConnectionError:
        pass
    err = capsys.readouterr().err
    assert len(calls) == 6
    assert len(err.strip().splitlines()) == 1 and "gave up after 6 attempts" in err, err
    logged = (tmp_path / "logs" / "hub.log").read_text().splitlines()
    assert sum("retry" in line for line in logged) == 5


def test_sync_push_and_rollback_options_have_help(capsys):
    from launcher.cli import main as cli_main
    for command in (["sync", "push", "--help"], ["rollback", "--help"]):
        assert cli_main(command) == 0
    out = capsys.readouterr().out
    assert "The revision's message" in out and "The stage to go back to" in out
