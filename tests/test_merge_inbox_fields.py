"""The inbox fields of the launcher's rounds (fractus/train/merge_inbox.py): the quorum a
round names, the boundary and stage it decides, a refused round; each malformed value
refused in one line."""

import pytest

from fractus.train.merge_inbox import MergeRefused, parse_inbox

SHA = "a" * 64


def test_a_round_names_its_quorum_at_their_tokens_and_decides_its_stages_boundary():
    entry = parse_inbox({"round": 3, "stage": 2, "boundary": 4, "path": "merge/round_00003.pt",
                         "sha256": SHA, "gpus": {"0": 96, "2": 128}})
    assert entry.adopts(0, 96) and entry.adopts(2, 128)
    assert not entry.adopts(0, 128) and not entry.adopts(1, 96)     # left out
    assert entry.decides(4, 2) and entry.decides(3, 2) and not entry.decides(5, 2)
    assert not entry.decides(4, 1)          # a rollback to stage 1 counts its boundaries anew
    plain = parse_inbox({"round": 1, "path": "merge/round_00001.pt", "sha256": SHA})
    assert plain.adopts(5, 12345) and not plain.decides(1, None)    # a hand-written inbox


def test_a_refused_round_decides_its_boundary_and_adopts_nowhere():
    entry = parse_inbox({"round": 2, "stage": 1, "boundary": 2, "refused": True, "gpus": {}})
    assert entry.refused and entry.decides(2, 1)
    assert not entry.adopts(0, 64)


@pytest.mark.parametrize("field, value", [
    ("boundary", 0), ("boundary", True), ("boundary", "3"), ("stage", 0), ("stage", 1001),
    ("gpus", {"zero": 1}), ("gpus", {"0": -1}), ("gpus", {"0": 1.5}), ("gpus", [0, 1]),
])
def test_malformed_round_fields_are_refused(field, value):
    data = {"round": 1, "path": "merge/round_00001.pt", "sha256": SHA, field: value}
    with pytest.raises(MergeRefused) as refused:
        parse_inbox(data)
    assert field in str(refused.value) and "\n" not in str(refused.value)
