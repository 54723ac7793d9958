"""`data push` records its revision by editing fractus-pod.yaml's `data:` alone: the user's
comments, the order of the keys and a provenance header stay as written."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from launcher.cli import main as cli_main
from launcher.config.yamlfile import set_top_level_key

SHARDS = ["data/shard_phase2_gpu0.npy", "data/shard_phase2_gpu1.npy"]


def _pod(tmp_path: Path) -> Path:
    pod = tmp_path / "pod"
    assert cli_main(["--pod-dir", str(pod), "init", "--preset", "tiny-cpu", "--no-data"]) == 0
    for gpu, rel in enumerate(SHARDS):
        (pod / rel).write_bytes(b"shard%d" % gpu * 1000)
    return pod


def test_data_push_keeps_the_users_comments_and_the_provenance_line(tmp_path):
    pod = _pod(tmp_path)
    config = pod / "fractus-pod.yaml"
    text = config.read_text().replace("data: null\n", "data: null   # filled by data push\n")
    text = ("# rebuilt from hf://me/run at revision 0123abcd\n" + text
            + "# my own notes: 8 x H200 rented until Friday\n")
    text = text.replace("save_every: 25\n", "save_every: 25   # every ~10 min at 1B\n")
    config.write_text(text)

    assert cli_main(["--pod-dir", str(pod), "data", "push",
                     "--to", f"file://{tmp_path / 'store'}"]) == 0
    after = config.read_text()
    data = yaml.safe_load(after)["data"]
    assert data["url"] == f"file://{tmp_path / 'store'}" and len(data["revision"]) == 64
    # every line but the data: one is kept, in its place
    assert [ln for ln in after.splitlines() if not ln.startswith(("data:", "  url:",
                                                                    "  revision:"))] == \
        [ln for ln in text.splitlines() if not ln.startswith("data:")]
    assert after.startswith("# rebuilt from hf://me/run at revision 0123abcd\n")

    # a second push to another store replaces the block, nothing else
    assert cli_main(["--pod-dir", str(pod), "data", "push",
                     "--to", f"file://{tmp_path / 'other'}"]) == 0
    again = config.read_text()
    assert yaml.safe_load(again)["data"]["url"] == f"file://{tmp_path / 'other'}"
    assert again.count("url:") == 1
    assert again.replace(f"file://{tmp_path / 'other'}", "") == \
        after.replace(f"file://{tmp_path / 'store'}", "").replace(
            data["revision"], yaml.safe_load(again)["data"]["revision"])


@pytest.mark.parametrize("text", [
    "a: 1\n# about data\ndata:\n  url: x   # old\n  revision: r\n\n# about b\nb: [1, 2]\n",
    "a: 1\ndata: {url: x, revision: r}\nb: 2\n",
    "a: 1\ndata:\n- x\n- y\nb: 2\n",
    "a: 1  # no data key yet",
    "# only a header\n",
])
def test_one_key_is_set_and_every_other_line_kept(text):
    value = {"url": "file:///s", "revision": "f" * 64}
    edited = set_top_level_key(text, "data", value, "t.yaml")
    expected = dict(yaml.safe_load(text) or {}, data=value)
    assert yaml.safe_load(edited) == expected
    kept = [ln for ln in text.splitlines()
            if ln.startswith(("#", "a:", "b:")) or ln == ""]
    assert [ln for ln in edited.splitlines() if ln in kept] == kept


def test_a_layout_the_line_edit_cannot_place_is_rewritten_with_its_header():
    text = "# header\n'data': 1\nb: 2\n"        # a quoted key: not found by the line edit
    edited = set_top_level_key(text, "data", {"url": "u"}, "t.yaml")
    assert yaml.safe_load(edited) == {"data": {"url": "u"}, "b": 2}
    assert edited.startswith("# header\n")
