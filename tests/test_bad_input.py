"""Bad input (issue 16, items 17-19 and 21): every mistake in a file a person writes, in the
manifest, a shard or a checkpoint is one `error:` line, exit 2, before anything starts, and
the pod is left byte for byte as it was (names and bytes of every file, the lock file and
the launcher's TensorBoard run included)."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from launcher.cli import main as cli_main
from tests.support.pod_files import MANIFEST
from tests.support.refusals import (CONFIG, edit_config, pod, pod_template,  # noqa: F401
                                     refused)


def tiny_checkpoint(path: Path, model: str = "tiny", claim: str | None = None) -> None:
    """A weights-only checkpoint of `model`, whose config says `claim` (default: model)."""
    from fractus.config import load_model_config
    from fractus.continuous_engine import ContinuousThoughtEngine
    torch.manual_seed(0)
    engine = ContinuousThoughtEngine.from_config(load_model_config(model))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model_state": engine.state_dict(),
                "config": load_model_config(claim or model).to_dict()}, path)


def name_checkpoint(pod: Path, rel: str) -> None:
    (pod / MANIFEST).write_text(json.dumps({"gpu_0": {"start_token": 0, "checkpoint": rel},
                                            "gpu_1": {"start_token": 0}}))


# ---- the pod config, stages and criteria files --------------------------------------------
ALIAS_BOMB = "\n".join(["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"] +
                       [f"a{k}: &a{k} [{', '.join([f'*a{k - 1}'] * 10)}]" for k in range(1, 9)])


def bomb_under(key: str) -> str:
    return f"{ALIAS_BOMB}\n{key}: *a8\n"


@pytest.mark.parametrize("write, words", [
    (lambda pod: (pod / CONFIG).write_bytes((pod / CONFIG).read_bytes() + b"# caf\xe9\n"),
     "byte 0xE9 is not UTF-8"),
    (lambda pod: edit_config(pod, shards="data/shard_{i}_{j}.npy"), "holds {j}"),
    (lambda pod: edit_config(pod, checkpoints="ckpt_{i}{.pt"), "not a path template"),
    (lambda pod: edit_config(pod, shards="data/s{i:>999999999}.npy"), "only {i} may be used"),
    (lambda pod: edit_config(pod, devices="cuda:0-99999999999"), "indices 0..1023"),
    (lambda pod: edit_config(pod, devices="cuda:7-0"), "runs backwards"),
    (lambda pod: edit_config(pod, devices="cuda:²"), "bad GPU list"),
    (lambda pod: edit_config(pod, devices="cpu:100000"), "from 1 to 256"),
    (lambda pod: edit_config(pod, poll_interval_s=-1), "poll_interval_s must be between"),
    (lambda pod: edit_config(pod, stop_grace_s=-5), "stop_grace_s must be between"),
    (lambda pod: edit_config(pod, stop_grace_s=float("nan")), "stop_grace_s must be between"),
    (lambda pod: edit_config(pod, save_every="often"), "save_every must be an integer"),
    (lambda pod: edit_config(pod, env={"BOGUS_VAR": 1}), "'BOGUS_VAR' is not a worker setting"),
    (lambda pod: edit_config(pod, model="nonexistent"), "model 'nonexistent' cannot be built"),
    (lambda pod: edit_config(pod, hub="s3://bucket/run"), "hub must be file://DIR or hf://"),
    (lambda pod: edit_config(pod, sync={"interval": float("inf")}), "sync.interval"),
    (lambda pod: edit_config(pod, demo_data={"tokens": -1, "vocab": 512, "seed": 0}),
     "demo_data.tokens"),
    (lambda pod: edit_config(pod, stages="manifests"), "is a directory, not a file"),
    (lambda pod: (pod / CONFIG).write_text((pod / CONFIG).read_text() + "env: [unclosed\n"),
     r"line \d+, column \d+"),
    (lambda pod: (pod / CONFIG).write_text(
        (pod / CONFIG).read_text().replace("save_every: 25\n", "") + bomb_under("save_every")),
     "expands to more than"),
    (lambda pod: (pod / CONFIG).write_text(
        (pod / CONFIG).read_text().replace("env:\n  SEQ: '32'\n  ALLOW_FRESH_START: '1'\n", "")
        + bomb_under("env")), "expands to more than"),
    (lambda pod: (pod / CONFIG).write_text(
        (pod / CONFIG).read_text() + "unknown: " + "[" * 2000 + "]" * 2000 + "\n"),
     "nested deeper than"),
    (lambda pod: (pod / "manifests/trusted_loss.yaml").write_text(
        (pod / "manifests/trusted_loss.yaml").read_text().replace("tolerance: 0.5",
                                                                   "tolerance: .nan")),
     "tolerance: must be a finite number"),
    (lambda pod: (pod / "manifests/trusted_loss.yaml").write_text(
        (pod / "manifests/trusted_loss.yaml").read_text().replace("band: 3.0", "band: .inf")),
     "band: must be a finite number"),
    (lambda pod: edit_config(pod, price_per_gpu_hour=-0.5),
     r"price_per_gpu_hour must be between 0 and 1e\+06, got -0.5"),
    (lambda pod: edit_config(pod, price_per_gpu_hour="2 EUR"),
     "price_per_gpu_hour must be a number"),
    (lambda pod: (pod / "manifests/trusted_loss.yaml").write_text(
        (pod / "manifests/trusted_loss.yaml").read_text().replace("fraction: 0.7",
                                                                   "fraction: 1.5")),
     r"peers.fraction: must be in \(0, 1\], got 1.5"),
], ids=["latin1", "field-j", "open-brace", "width-spec", "huge-range", "backwards", "superscript",
        "cpu-100000", "poll-negative", "grace-negative", "grace-nan", "a-int", "bogus-env",
        "model", "s3-hub", "sync-inf", "demo-data", "stages-dir", "yaml-line", "bomb-save-every",
        "bomb-env", "deep", "tolerance-nan", "band-inf", "price-negative", "price-text",
        "peers-fraction"])
def test_a_bad_config_file_is_one_line_before_anything(pod, capsys, write, words):
    write(pod)
    line = refused(pod, capsys)
    assert __import__("re").search(words, line), line


def test_the_criteria_file_has_the_values_these_tests_replace(pod):
    text = (pod / "manifests/trusted_loss.yaml").read_text()
    assert "tolerance: 0.5" in text and "band: 3.0" in text and "fraction: 0.7" in text


def test_a_yaml_error_names_its_line(pod, capsys):
    (pod / CONFIG).write_text("model: tiny\ndevices: cpu:2\nenv: {SEQ: 32\n")
    line = refused(pod, capsys)
    assert "line 4" in line or "line 3" in line, line


@pytest.mark.parametrize("args, words", [
    (("launch", "--stage", "1", "--max-time", "nan"), "--max-time must be a number"),
    (("launch", "--stage", "1", "--max-time", "inf"), "--max-time must be a number"),
    (("status",), "hub must be file://DIR"),
])
def test_bad_options_and_status_on_a_bad_hub(pod, capsys, args, words):
    if args[0] == "status":
        edit_config(pod, hub="s3://bucket/run")
    assert words in refused(pod, capsys, *args)


# ---- the manifest ---------------------------------------------------------------------------
@pytest.mark.parametrize("text, words", [
    ('{"gpus": {"\u00b2": {"start_token": 0}}}', "is not a GPU index"),
    ('{"gpu_\u0661": {"start_token": 0}}', "is not a GPU index"),
    ('{"gpus": [{"start_token": 640, "stage": 3}]}', "gpus must be an object"),
    ('{"gpu_0": {"start_token": 0, "ema_tf": NaN}}', "NaN is not JSON"),
    ('{"gpu_0": {"start_token": 0, "lb": Infinity}}', "Infinity is not JSON"),
    ('{"gpu_0": {"start_token": 0, "lb": -Infinity}}', "-Infinity is not JSON"),
    ('{"gpu_0": {"start_token": 0, "lb": 1e400}}', "lb must be a number"),
    ('{"note": ' + "[" * 2000 + "]" * 2000 + "}", "nested deeper than"),
    ('{"note": ' + "[" * 100 + "]" * 100 + "}", "nested deeper than"),
], ids=["superscript", "arabic-indic", "gpus-list", "nan", "inf", "-inf", "1e400", "deep", "deep100"])
def test_a_bad_manifest_is_one_line(pod, capsys, text, words):
    (pod / MANIFEST).write_text(text)
    assert words in refused(pod, capsys)


def test_a_manifest_that_is_a_directory_is_one_line(pod, capsys):
    (pod / MANIFEST).mkdir()
    assert "is a directory" in refused(pod, capsys)


def test_a_gpu_like_foreign_key_is_still_kept(tmp_path):
    """Only digit-looking keys are refused: `gpu_count` is the user's own field."""
    from launcher.pod.manifest import read_manifest, write_manifest
    path = tmp_path / "m.json"
    path.write_text('{"gpu_count": 8, "gpu_0": {"start_token": 5}}')
    manifest = read_manifest(path)
    write_manifest(manifest)
    assert json.loads(path.read_text())["gpu_count"] == 8


# ---- shards and checkpoints: refused after the pod lock, the pod left as it was ---------------
def _zip_bomb(path: Path) -> None:
    """A zip whose data.pkl record is deflated and declares 100 MiB."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("archive/data.pkl", b"\0" * (100 << 20))


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


SHARD0 = "data/shard_phase2_gpu0.npy"


@pytest.mark.parametrize("damage, words", [
    (lambda pod: np.save(pod / SHARD0, np.zeros(1000, dtype=np.float32)),
     "expected a 1-D integer array"),
    (lambda pod: np.save(pod / SHARD0, np.zeros((1000, 2), dtype=np.int32)),
     "expected a 1-D integer array"),
    (lambda pod: (pod / SHARD0).write_bytes(b""), "not a readable .npy file"),
    (lambda pod: _fifo(pod / SHARD0), "not a regular file"),
    (lambda pod: (pod / SHARD0).unlink() or (pod / SHARD0).mkdir(), "is a directory"),
    (lambda pod: (pod / "checkpoints/x.pt").mkdir() or name_checkpoint(pod, "checkpoints/x.pt"),
     "is a directory, not a checkpoint file"),
    (lambda pod: _zip_bomb(pod / "checkpoints/x.pt") or name_checkpoint(pod, "checkpoints/x.pt"),
     "declares 104,857,600 bytes"),
    (lambda pod: tiny_checkpoint(pod / "checkpoints/x.pt", "small", claim="tiny")
     or name_checkpoint(pod, "checkpoints/x.pt"), "tensors do not fit model 'tiny'"),
    (lambda pod: tiny_checkpoint(pod / "checkpoints/x.pt", "small")
     or name_checkpoint(pod, "checkpoints/x.pt"), "written for another model"),
], ids=["float32", "2-D", "0-byte", "fifo", "dir-shard", "dir-ckpt", "zip-bomb", "shapes",
        "config"])
def test_a_bad_shard_or_checkpoint_is_refused_and_nothing_is_written(pod, capsys, damage,
                                                                     words):
    damage(pod)
    line = refused(pod, capsys)
    assert words in line, line
    assert "past the end" not in line and "missing" not in line


def test_a_refusal_after_the_lock_restores_an_existing_lock_file(pod, capsys):
    """A pod that ran before has logs/launcher.lock and a launcher TensorBoard run: both stay
    as they were (the refusal used to rewrite the one and add a 40-byte file to the other)."""
    (pod / "logs/launcher.lock").write_text('{"pid": 1, "since": 0}')
    (pod / "logs/tb/launcher").mkdir(parents=True)
    (pod / SHARD0).unlink()                 # refused after the lock, by the old code too
    refused(pod, capsys)


def test_a_good_checkpoint_passes_the_shape_check(pod):
    from launcher.pod.ckpt_trust import read_identity
    tiny_checkpoint(pod / "checkpoints/x.pt")
    assert read_identity(pod / "checkpoints/x.pt", "tiny", pod).gpu is None


# ---- exit codes and texts ------------------------------------------------------------------
def test_probe_of_a_checkpoint_that_does_not_load_is_bad_input(pod, capsys):
    """`probe --checkpoint X` on a file that is no checkpoint exited 1 ("probe exited 2:
    cannot load"): the input is the user's to fix, exit 2."""
    (pod / "checkpoints/x.pt").write_bytes(b"not a checkpoint")
    line = refused(pod, capsys, "probe", "--checkpoint", str(pod / "checkpoints/x.pt"),
                   "--shard", str(pod / SHARD0))
    assert "cannot probe x.pt" in line and "cannot load checkpoint" in line


def test_status_json_names_the_stage_of_a_pod_not_running(pod, capsys):
    (pod / MANIFEST).write_text(json.dumps({"gpu_0": {"start_token": 0, "stage": 3}}))
    assert cli_main(["--pod-dir", str(pod), "status", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    stages = yaml.safe_load((pod / "manifests/stages.yaml").read_text())["stages"]
    assert report["stage"] == 3 and report["stage_name"] == stages[3]["name"]


def test_init_suggests_a_stage_the_readme_may_run(tmp_path, capsys):
    """init said `next: launch --stage 1` in the README line that then runs stage 3."""
    assert cli_main(["--pod-dir", str(tmp_path / "p"), "init", "--no-data"]) == 0
    out = capsys.readouterr().out
    assert "launch --stage N" in out and "1 to 5" in out and "--stage 1" not in out


def test_many_missing_shards_are_one_short_line(pod, capsys):
    """cpu:100000 printed one line of 20,000 characters; up to eight shards are named."""
    edit_config(pod, devices="cpu:30")
    line = refused(pod, capsys)
    assert "28 token shard(s) missing" in line and "and 20 more" in line, line


# ---- alerts: (issue 19) -------------------------------------------------------------------
HOOK_ENV = "FRACTUS_TEST_WEBHOOK_URL"


@pytest.mark.parametrize("alerts, value, says", [
    ({"webhooks": [{"format": "teams", "url_env": HOOK_ENV}]}, "https://example.org/h",
     "format must be one of generic, ntfy, slack, discord, got 'teams'"),
    ({"webhooks": [{"format": "slack", "url_env": HOOK_ENV}]}, "ftp://example.org/T0/secret",
     f"${HOOK_ENV} must hold an http:// or https:// URL, it holds a 'ftp' URL"),
    ({"webhooks": [{"format": "slack", "url_env": HOOK_ENV}]}, "example.org/T0/secret",
     f"${HOOK_ENV} must hold an http:// or https:// URL, it holds no URL"),
    ({"webhooks": [{"format": "ntfy", "url_env": HOOK_ENV}]}, None, f"${HOOK_ENV} is not set"),
])
def test_a_bad_alert_webhook_is_refused_in_one_line_without_its_url(pod, capsys, monkeypatch,
                                                                     alerts, value, says):
    edit_config(pod, alerts=alerts)
    if value is None:
        monkeypatch.delenv(HOOK_ENV, raising=False)
    else:
        monkeypatch.setenv(HOOK_ENV, value)
    line = refused(pod, capsys)
    assert says in line
    assert "secret" not in line            # the URL (a secret) is never echoed
    assert refused(pod, capsys, "alert", "test") == line


def test_a_webhook_variable_passed_to_the_workers_is_refused(pod, capsys, monkeypatch):
    monkeypatch.setenv(HOOK_ENV, "https://example.org/h")
    edit_config(pod, alerts={"webhooks": [{"format": "ntfy", "url_env": HOOK_ENV}]},
                pass_env=[HOOK_ENV])
    assert f"pass_env: {HOOK_ENV} holds a webhook URL" in refused(pod, capsys)


def test_alert_test_without_alerts_says_how_to_add_them(pod, capsys):
    assert "no alerts: in" in refused(pod, capsys, "alert", "test")
