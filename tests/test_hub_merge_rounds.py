"""The merge rounds' state on the hub (launcher/hub/round_files.py): every push carries the
ledger, the inbox, the outer state and the newest adopted round's merged file (never the
candidate outer state); a pod rebuilt from the hub gets them back byte-exact; round state
that does not verify (bytes changed on the hub, an outer state of another round, a ledger
path out of merge/, a merged file other than the ledger's) is refused in one line with
nothing written; the commit that carried an adopted round is a `sync history` milestone
retention keeps; a push carrying a round's merged file stops naming the older rounds' (the
hub's head names only the newest, retention frees the others). The round files are
outer_step's own, on small checkpoints."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from launcher.cli import main as cli_main
from launcher.config.podconfig import load_pod_config
from launcher.files import atomic_write_text, sha256_file
from launcher.hub import open_store
from launcher.hub.outer_step import (OuterSettings, commit_outer_state, outer_step,
                                     read_outer_state)
from launcher.hub.round_files import ROUND_FILE, round_files
from launcher.hub.sync import HubSync, RunLease
from launcher.paths import (MERGE_INBOX_FILE, OUTER_STATE_FILE, OUTER_STATE_PENDING,
                            ROUNDS_LEDGER, merged_round_path)
from launcher.pod.ckpt_index import CheckpointIndex
from launcher.pod.events import EventLog, read_events
from launcher.pod.manifest import read_manifest
from tests.support.hub_server import test_hub  # noqa: F401  (pytest fixture)
from tests.support.retention_pod import (  # noqa: F401  (hub_url: a pytest fixture)
    GPUS, checkpoint_objects, hub_url, make_pod, new_checkpoints, push, rebuilds_a_pod)

pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")

NESTEROV = OuterSettings("nesterov", lr=0.7, momentum=0.9)
CARRIED = (ROUNDS_LEDGER, MERGE_INBOX_FILE, OUTER_STATE_FILE)


def _gpu_checkpoint(path: Path, gpu: int, n: int) -> Path:
    """A GPU's checkpoint at round n as outer_step reads it: two parameters, a carried buffer."""
    torch.manual_seed(100 * n + gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model_state": {"w": torch.randn(4, 3), "b": torch.randn(3),
                                "thought_state": torch.randn(1, 1, 2)}, "config": {}}, path)
    return path


def _ledger(pod: Path) -> dict:
    path = pod / ROUNDS_LEDGER
    return json.loads(path.read_text()) if path.is_file() else {
        "format": "fractus-pod-rounds-v1", "origins": {"1": {str(g): 0 for g in range(GPUS)}},
        "rounds": []}


def _record(pod: Path, n: int, state: str, sha: str | None) -> None:
    ledger = _ledger(pod)
    ledger["rounds"] = [r for r in ledger["rounds"] if r["round"] != n] + [{
        "round": n, "stage": 1, "boundary": n, "state": state,
        "gpus": {str(g): {"at_token": 1000 * n, "checkpoint": f"merge_src/r{n}_gpu{g}.pt",
                          "sha256": "0" * 64, "tokens": 1000} for g in range(GPUS)},
        "left_out": [], "weights": [1 / GPUS] * GPUS,
        "outer": {"step": "nesterov", "lr": 0.7, "momentum": 0.9},
        "merged": merged_round_path(n), "merged_sha256": sha, "gate": None,
        "reason": f"round {n} {state}", "seconds": 1.5}]
    atomic_write_text(pod / ROUNDS_LEDGER, json.dumps(ledger, indent=1) + "\n")


def merge_round(pod: Path, n: int, adopt: bool = True) -> None:
    """Round n as the orchestration runs it: outer_step's candidate, the ledger's record,
    then (adopted) the outer state's commit and the workers' inbox."""
    sources = [_gpu_checkpoint(pod / "merge_src" / f"r{n}_gpu{g}.pt", g, n) for g in range(GPUS)]
    report = outer_step(pod, n, sources, NESTEROV, commit=False)
    _record(pod, n, "adopted" if adopt else "merging", report.sha256)
    if adopt:
        commit_outer_state(pod, n)
        atomic_write_text(pod / MERGE_INBOX_FILE, json.dumps(
            {"round": n, "path": merged_round_path(n), "sha256": report.sha256}) + "\n")


def _carried(n: int) -> tuple[str, ...]:
    return (*CARRIED, merged_round_path(n))


def test_a_push_carries_the_round_state_and_a_rebuilt_pod_gets_it_back_byte_exact(
        tmp_path, capsys, hub_url):
    pod = make_pod(tmp_path, hub_url, None)
    store = open_store(hub_url, pod)
    new_checkpoints(pod, 1000)
    merge_round(pod, 1)
    merge_round(pod, 2)
    merge_round(pod, 3, adopt=False)        # merging: a candidate, not the pod's state yet
    assert (pod / OUTER_STATE_PENDING).is_file()
    first = push(pod, capsys)
    held = store.files(first)
    for rel in _carried(2):
        assert held[rel].sha256 == sha256_file(pod / rel), rel
    assert OUTER_STATE_PENDING not in held and merged_round_path(3) not in held

    # Unchanged: skipped. A round adopted with no new checkpoint: pushed.
    assert cli_main(["--pod-dir", str(pod), "sync", "push"]) == 0
    assert capsys.readouterr().out.startswith("skipped")
    (pod / OUTER_STATE_PENDING).unlink()
    (pod / merged_round_path(3)).unlink()
    merge_round(pod, 3)
    head = push(pod, capsys)
    assert head != first
    assert store.files(head)[OUTER_STATE_FILE].sha256 == sha256_file(pod / OUTER_STATE_FILE)

    rebuilt = tmp_path / "rebuilt"
    rebuilds_a_pod(rebuilt, hub_url, head)
    for rel in _carried(3):
        assert (rebuilt / rel).read_bytes() == (pod / rel).read_bytes(), rel
    assert not (rebuilt / OUTER_STATE_PENDING).exists()
    assert read_outer_state(rebuilt / OUTER_STATE_FILE, expect_round=3).settings == NESTEROV
    # An older revision rebuilds its own round, not the newest.
    older = tmp_path / "older"
    rebuilds_a_pod(older, hub_url, first)
    assert json.loads((older / ROUNDS_LEDGER).read_bytes()) == \
        json.loads(store.read_bytes(ROUNDS_LEDGER, first))
    assert read_outer_state(older / OUTER_STATE_FILE).round == 2


def test_the_launchers_sync_pushes_a_round_when_asked_with_its_reason(tmp_path, capsys):
    hub_url = f"file://{tmp_path / 'store'}"
    pod = make_pod(tmp_path, hub_url, None)
    new_checkpoints(pod, 1000)
    push(pod, capsys)
    merge_round(pod, 1)
    config = load_pod_config(pod)
    log = EventLog(pod)
    sync = HubSync(pod, config, read_manifest(pod / config.manifest), CheckpointIndex(pod),
                   log, RunLease(pod, log))          # sync interval: one hour
    store = open_store(hub_url, pod)
    for n in (1, 2):        # the second: the same checkpoints and manifest, a new round
        if n == 2:
            merge_round(pod, 2)
        sync.manifest_changed(f"merge round {n} adopted")
        sync.tick()
        assert sync.busy
        sync.finish()       # waits for it; the stop push after it: nothing new, skipped
        pushed = [e for e in read_events(pod) if e["event"] == "sync_pushed"]
        assert pushed[-1]["reason"] == f"merge round {n} adopted"
        held = store.files(pushed[-1]["revision"])
        for rel in _carried(n):
            assert held[rel].sha256 == sha256_file(pod / rel), rel
        assert f"merge round {n} adopted" in store.history()[0].message
    assert [e["reason"] for e in read_events(pod) if e["event"] == "sync_pushed"] == \
        ["by hand", "merge round 1 adopted", "merge round 2 adopted"]


def _rebuild_refused(tmp_path: Path, hub_url: str, capsys, revision: str | None = None) -> str:
    """`launch --from-hub`: exit 2, one line, the directory left as it was (none)."""
    target = tmp_path / "refused"
    args = ["--pod-dir", str(target), "launch", "--from-hub", hub_url]
    code = cli_main(args + (["--revision", revision] if revision else []))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "merge round state does not verify" in err[0] and "nothing restored" in err[0]
    assert not target.exists()
    return err[0]


@pytest.fixture
def pushed_pod(tmp_path, capsys):
    """A file:// pod whose head carries round 2 (rounds 1 and 2 adopted)."""
    hub_url = f"file://{tmp_path / 'store'}"
    pod = make_pod(tmp_path, hub_url, None)
    new_checkpoints(pod, 1000)
    merge_round(pod, 1)
    merge_round(pod, 2)
    push(pod, capsys)
    return pod, hub_url, open_store(hub_url, pod)


def test_an_outer_state_whose_bytes_changed_on_the_hub_is_refused(pushed_pod, tmp_path,
                                                                   capsys):
    pod, hub_url, store = pushed_pod
    obj = store._object(store.files()[OUTER_STATE_FILE].sha256)
    os.chmod(obj, 0o644)
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0xFF
    obj.write_bytes(bytes(data))
    line = _rebuild_refused(tmp_path, hub_url, capsys)
    assert OUTER_STATE_FILE in line


def _commit(store, pod: Path, files: dict[str, bytes]) -> str:
    """Another writer's commit of `files` (consistent with the hub index: only content
    checks can refuse it)."""
    stage = pod.parent / "other"
    stage.mkdir(exist_ok=True)
    paths = {}
    for rel, data in files.items():
        paths[rel] = stage / rel.replace("/", "_")
        paths[rel].write_bytes(data)
    return store.push(paths, "another writer")


def test_an_outer_state_of_another_round_is_refused(pushed_pod, tmp_path, capsys):
    pod, hub_url, store = pushed_pod
    round_1 = tmp_path / "round1"
    merge_round(round_1, 1)
    _commit(store, pod, {OUTER_STATE_FILE: (round_1 / OUTER_STATE_FILE).read_bytes()})
    line = _rebuild_refused(tmp_path, hub_url, capsys)
    assert "round 1's outer state, expected round 2's" in line
    _commit(store, pod, {OUTER_STATE_FILE: b"not a checkpoint"})
    _rebuild_refused(tmp_path, hub_url, capsys)


@pytest.mark.parametrize("merged", ["/etc/passwd", "merge/../../../etc/passwd",
                                    "checkpoints/fractus_1b_gpu0.pt", "merge/outer_state.pt"])
def test_a_ledger_naming_a_path_outside_merge_is_refused(pushed_pod, tmp_path, capsys, merged):
    pod, hub_url, store = pushed_pod
    ledger = _ledger(pod)
    ledger["rounds"][-1]["merged"] = merged
    _commit(store, pod, {ROUNDS_LEDGER: json.dumps(ledger).encode()})
    line = _rebuild_refused(tmp_path, hub_url, capsys)
    assert "not a round file inside merge/" in line
    # A push reads the pod's own ledger the same way: none of the round state goes up.
    atomic_write_text(pod / ROUNDS_LEDGER, json.dumps(ledger))
    assert round_files(pod) == {}


@pytest.mark.parametrize("bad", [{"round": 0}, {"round": 10**12}, {"round": True},
                                 {"state": "maybe"}, {"merged_sha256": "f" * 12},
                                 {"merged": "merge/round_00001.pt"}])
def test_a_ledger_number_or_field_out_of_range_is_refused(pushed_pod, tmp_path, capsys, bad):
    pod, hub_url, store = pushed_pod
    ledger = _ledger(pod)
    ledger["rounds"][-1].update(bad)
    _commit(store, pod, {ROUNDS_LEDGER: json.dumps(ledger).encode()})
    _rebuild_refused(tmp_path, hub_url, capsys)


def test_a_merged_file_other_than_the_ledgers_is_refused(pushed_pod, tmp_path, capsys):
    pod, hub_url, store = pushed_pod
    _commit(store, pod, {merged_round_path(2): (pod / merged_round_path(1)).read_bytes()})
    line = _rebuild_refused(tmp_path, hub_url, capsys)
    assert merged_round_path(2) in line and "the ledger records" in line


def test_an_adopted_round_is_a_milestone_retention_keeps(tmp_path, capsys):
    hub_url = f"file://{tmp_path / 'store'}"
    pod = make_pod(tmp_path, hub_url, {"keep": 1})
    store = open_store(hub_url, pod)
    new_checkpoints(pod, 1000)
    push(pod, capsys)
    new_checkpoints(pod, 2000)
    merge_round(pod, 1)
    round_1 = push(pod, capsys)
    for token in (3000, 4000):
        new_checkpoints(pod, token)
        head = push(pod, capsys)
    assert cli_main(["--pod-dir", str(pod), "sync", "history"]) == 0
    by_rev = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "kept: merge round 1" in by_rev[round_1[:12]], by_rev
    assert sum("merge round" in line for line in by_rev.values()) == 1
    named = {sha for h in store.history() for sha in checkpoint_objects(store, h.revision)}
    held = {sha for sha in store.stored_objects() if sha in named}
    assert held == {*checkpoint_objects(store, head), *checkpoint_objects(store, round_1)}
    rebuilt = tmp_path / "rebuilt"
    rebuilds_a_pod(rebuilt, hub_url, round_1)
    for rel in _carried(1):
        assert sha256_file(rebuilt / rel) == store.files(round_1)[rel].sha256, rel
    # Without milestones the round is not kept: the same policy as a stage's end.
    config = yaml.safe_load((pod / "fractus-pod.yaml").read_text())
    config["retention"] = {"keep": 1, "milestones": False}
    (pod / "fractus-pod.yaml").write_text(yaml.safe_dump(config))
    assert cli_main(["--pod-dir", str(pod), "sync", "history"]) == 0
    assert "merge round" not in capsys.readouterr().out


# ---- a push drops the older rounds' merged files ------------------------------------------
# A push carrying a round's merged file stops naming the older rounds' (snapshot.py's `drop`,
# Store.push's `drop`): the head names only the newest, as the pod keeps only the newest, so
# retention frees the older ones like old checkpoints; a milestone revision keeps its own,
# and an older revision still rebuilds with the round file it carried. On hf:// the dropped
# paths leave the repository's tree as well as the hub index.
def _round_files(paths) -> set[str]:
    return {p for p in paths if ROUND_FILE.match(p)}


def _three_rounds(pod: Path, capsys) -> tuple[list[str], dict[int, str]]:
    """Rounds 1, 2, 3 adopted, each pushed with new checkpoints; the pod keeping only the
    newest round file, as the orchestration does. (revisions, round -> its file's sha256)."""
    revisions, shas = [], {}
    for n in (1, 2, 3):
        new_checkpoints(pod, 1000 * n)
        merge_round(pod, n)
        shas[n] = sha256_file(pod / merged_round_path(n))
        if n > 1:
            (pod / merged_round_path(n - 1)).unlink()
        revisions.append(push(pod, capsys))
    return revisions, shas


def test_the_head_names_only_the_newest_round_file_and_an_older_revision_rebuilds_its_own(
        tmp_path, capsys, hub_url):
    pod = make_pod(tmp_path, hub_url, {"keep": 1})       # milestones: each round kept
    store = open_store(hub_url, pod)
    revisions, shas = _three_rounds(pod, capsys)
    for n, rev in enumerate(revisions, 1):
        held = store.files(rev)
        assert _round_files(held) == {merged_round_path(n)}, n
        assert held[merged_round_path(n)].sha256 == shas[n]
    if hub_url.startswith("hf://"):           # gone from the tree, not only from the index
        tree = store._api.list_repo_files(store.repo_id, revision=revisions[-1])
        assert _round_files(tree) == {merged_round_path(3)}
    # A plain pull of the head (every tracked path) brings the newest round file only.
    pulled = tmp_path / "pulled"
    pulled.mkdir()
    open_store(hub_url, pulled).pull(revision=revisions[-1])
    assert _round_files(str(p.relative_to(pulled)) for p in pulled.rglob("*.pt")) == \
        {merged_round_path(3)}
    # An older revision (a milestone: `kept: merge round 1`) rebuilds with its own round.
    older = tmp_path / "older"
    rebuilds_a_pod(older, hub_url, revisions[0])
    assert sha256_file(older / merged_round_path(1)) == shas[1]
    assert not (older / merged_round_path(3)).exists()
    assert cli_main(["--pod-dir", str(pod), "sync", "history"]) == 0
    out = capsys.readouterr().out
    assert all(f"kept: merge round {n}" in out for n in (1, 2)), out     # 3: the newest


def test_retention_frees_the_older_round_files_without_milestones(tmp_path, capsys, hub_url):
    pod = make_pod(tmp_path, hub_url, {"keep": 1, "milestones": False})
    store = open_store(hub_url, pod)
    _revisions, shas = _three_rounds(pod, capsys)
    stored = store.stored_objects()
    assert shas[3] in stored
    assert shas[1] not in stored and shas[2] not in stored


def test_a_push_rebased_on_another_writers_commit_drops_from_the_head_it_lands_on(
        tmp_path, hub_url):
    pod = tmp_path / "pod"
    pod.mkdir()
    store = open_store(hub_url, pod)
    files = {}
    for n in (1, 2, 3):
        files[n] = pod / f"round{n}.bin"
        files[n].write_bytes(bytes([n]) * 1000)
    drop = ROUND_FILE.match
    base = store.push({merged_round_path(1): files[1]}, "round 1")
    # Another writer lands round 3 (dropping round 1) after this push read its base.
    store.push({merged_round_path(3): files[3]}, "round 3", drop=drop)
    head = store.push({merged_round_path(2): files[2]}, "round 2", base=base, drop=drop)
    assert _round_files(store.files(head)) == {merged_round_path(2)}
    assert _round_files(store.files(base)) == {merged_round_path(1)}
    if hub_url.startswith("hf://"):
        tree = store._api.list_repo_files(store.repo_id, revision=head)
        assert _round_files(tree) == {merged_round_path(2)}


def test_a_head_still_naming_older_round_files_is_pushed_not_skipped(tmp_path, capsys):
    hub_url = f"file://{tmp_path / 'store'}"
    pod = make_pod(tmp_path, hub_url, None)
    store = open_store(hub_url, pod)
    new_checkpoints(pod, 1000)
    merge_round(pod, 1)
    push(pod, capsys)
    merge_round(pod, 2)
    # The round pushed as before drops were: the head names round 1's file besides.
    store.push({rel: pod / rel for rel in _round_files_of(pod)}, "pushed before drops")
    (pod / merged_round_path(1)).unlink()
    assert _round_files(store.files()) == {merged_round_path(1), merged_round_path(2)}
    head = push(pod, capsys)                  # the same checkpoints, manifest and rounds
    assert _round_files(store.files(head)) == {merged_round_path(2)}


def _round_files_of(pod: Path) -> list[str]:
    """The round state the pod holds now (ledger, inbox, outer state, round files)."""
    return [str(p.relative_to(pod)) for p in (pod / "merge").iterdir()
            if p.is_file() and not p.name.endswith(".next.pt")]
