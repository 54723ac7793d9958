"""Pod config, init presets, device strings and the stage file."""

import pytest
import yaml

from launcher.errors import UserError
from launcher.config.devices import Slot, parse_devices
from launcher.config.podconfig import DEFAULT_MANIFESTS, PRESETS, load_pod_config
from launcher.pod.setup_init import init_pod
from launcher.config.stages import get_stage, load_stages, parse_stages
from launcher.worker.process import WorkerSpec, build_env


def test_init_tiny_cpu_writes_a_loadable_self_contained_pod(tmp_path):
    written, kept = init_pod(tmp_path, "tiny-cpu")
    assert kept == []
    names = {p.relative_to(tmp_path).as_posix() for p in written}
    assert names == {"fractus-pod.yaml", "manifests/stages.yaml", "manifests/trusted_loss.yaml"}
    config = load_pod_config(tmp_path)
    assert config.model == "tiny" and config.devices == "cpu:2" and config.hub == "file://hub"
    assert load_stages(tmp_path / config.stages)[3].settings["FRACTUS_ATTN_IMPL"] == "chunked"
    with pytest.raises(UserError, match="already exists"):
        init_pod(tmp_path, "tiny-cpu")
    init_pod(tmp_path, "1b-8gpu", force=True)
    assert load_pod_config(tmp_path).model == "1b"


def test_the_tiny_preset_gets_a_probe_band_for_its_model_and_keeps_the_comments(tmp_path):
    from launcher.checks.trusted_loss import load_criteria_file
    from launcher.config.podconfig import DEFAULT_MANIFESTS
    from launcher.pod.setup_init import edit_yaml_values
    tiny, big = tmp_path / "tiny", tmp_path / "big"
    init_pod(tiny, "tiny-cpu")
    init_pod(big, "1b-8gpu")
    assert load_criteria_file(tiny / "manifests" / "trusted_loss.yaml") \
        .probe_tolerance.relativeBand == 1.0
    assert load_criteria_file(big / "manifests" / "trusted_loss.yaml") \
        .probe_tolerance.relativeBand is None
    trend = lambda pod: load_criteria_file(pod / "manifests" / "trusted_loss.yaml").criteria.trend
    assert trend(tiny).tolerance == 0.5 and trend(big).tolerance == 0.15   # the demo's noise
    original = (DEFAULT_MANIFESTS / "trusted_loss.yaml").read_text()
    edited = (tiny / "manifests" / "trusted_loss.yaml").read_text()
    comments = [line for line in original.splitlines() if line.lstrip().startswith("#")]
    assert comments and all(line in edited.splitlines() for line in comments)
    expected = yaml.safe_load(original)
    expected["probe"]["relativeBand"] = 1.0
    expected["checks"]["trend"]["tolerance"] = 0.5
    assert yaml.safe_load(edited) == expected           # nothing else changed
    with pytest.raises(ValueError, match="no"):
        edit_yaml_values(original, {("probe", "missing_key"): 1})


def test_unknown_preset_and_missing_config_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="unknown preset"):
        init_pod(tmp_path, "huge")
    with pytest.raises(UserError, match="fractus-pod init"):
        load_pod_config(tmp_path)


@pytest.mark.parametrize("patch, words", [
    ({"batch": 4}, "unknown key"),
    ({"save_every": "often"}, "save_every must be an integer"),
    ({"log_every": 0}, "log_every must be between 1 and"),
    ({"shards": "data/shard.npy"}, "must contain {i}"),
    ({"devices": "tpu:4"}, "devices"),
    ({"env": ["SEQ=32"]}, "env must be a mapping"),
])
def test_bad_config_values_are_one_line_user_errors(tmp_path, patch, words):
    init_pod(tmp_path, "tiny-cpu")
    path = tmp_path / "fractus-pod.yaml"
    data = yaml.safe_load(path.read_text())
    data.update(patch)
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(UserError, match=words):
        load_pod_config(tmp_path)


def test_device_strings():
    assert parse_devices("cpu:3") == [Slot(0, "cpu"), Slot(1, "cpu"), Slot(2, "cpu")]
    assert [s.gpu for s in parse_devices("cuda:0-2,5")] == [0, 1, 2, 5]
    assert [s.gpu for s in parse_devices("cuda:0-7", "1,3")] == [1, 3]
    for bad in ("cpu:0", "cpu:x", "cuda:0,0", "cuda:a-b", "gpu:1"):
        with pytest.raises(UserError):
            parse_devices(bad)
    with pytest.raises(UserError, match="not in devices"):
        parse_devices("cpu:2", "2")


def test_repository_stages_follow_the_users_ramp():
    stages = load_stages(DEFAULT_MANIFESTS / "stages.yaml")
    assert sorted(stages) == [1, 2, 3, 4, 5]
    assert stages[1].settings == {"BATCH": "4", "CE_CHUNK": "0", "FRACTUS_ATTN_IMPL": "cumsum",
                                  "COMPILE": "0", "ACCUM": "1"}
    assert stages[2].settings["CE_CHUNK"] == "2048"
    assert stages[3].settings["FRACTUS_ATTN_IMPL"] == "chunked"
    assert stages[4].settings["COMPILE"] == "1" and stages[4].settings["BATCH"] == "8"
    assert stages[5].settings["ACCUM"] == "2"
    assert [stages[n].exact for n in range(1, 6)] == [True, True, True, False, False]
    assert all(s.window > 0 for s in stages.values())
    with pytest.raises(UserError, match="unknown stage 6"):
        get_stage(stages, 6)


@pytest.mark.parametrize("data, words", [
    ({"stages": {1: {"settings": {"BATCHSIZE": 4}}}}, "not worker settings"),
    ({"stages": {1: {}, 3: {}}}, "without gaps"),
    ({"stages": {1: {"window": -1}}}, "window"),
    ({"stages": {1: {"window": 10**30}}}, "stage 1: window must be an integer from 0 to "
                                          "1000000000"),
    ({"stages": {1: {"exact": "yes"}}}, "exact"),
    ({"stages": {"one": {}}}, "integer"),
    ({"stages": {1: {"settngs": {}}}}, r"unknown key\(s\) \['settngs'\]; known: \['exact', 'name', 'settings', 'window'\]"),
    ({}, "stages:"),
])
def test_bad_stage_files(data, words):
    with pytest.raises(UserError, match=words):
        parse_stages(data, "stages.yaml")


def test_worker_env_layers_stage_then_pod_then_identity(tmp_path):
    config = PRESETS["tiny-cpu"]
    spec = WorkerSpec(Slot(1, "cpu"), {"BATCH": "4", "CE_CHUNK": "2048"}, start_token=640,
                      ckpt_in="checkpoints/retained/gpu1/x.pt", max_steps=10, fault="nan@3")
    env = build_env(config, spec, base={"BATCH": "99", "LR": "1", "PATH": "/bin"})
    assert env["BATCH"] == "4" and "LR" not in env and env["PATH"] == "/bin"  # no shell leaks
    assert env["SEQ"] == "32" and env["CE_CHUNK"] == "2048"
    assert env["GPU_ID"] == "1" and env["DEVICE"] == "cpu" and env["OMP_NUM_THREADS"] == "1"
    assert env["START_TOKEN"] == "640" and env["CKPT_IN"].endswith("x.pt")
    assert env["SHARD"] == "data/shard_phase2_gpu1.npy" and env["METRICS"].endswith("gpu1.jsonl")
    assert env["MAX_STEPS"] == "10" and env["FRACTUS_FAULT"] == "nan@3"
    cuda = build_env(config, WorkerSpec(Slot(5, "cuda"), {}), base={})
    assert cuda["CUDA_VISIBLE_DEVICES"] == "5" and cuda["DEVICE"] == "cuda"
    assert "START_TOKEN" not in cuda and "CKPT_IN" not in cuda
    from fractus.train.env import WorkerSettings
    settings = WorkerSettings.from_env(env)          # the worker accepts what we build
    assert settings.gpu_id == 1 and settings.start_token == 640 and settings.batch == 4


def test_a_bad_stage_setting_is_refused_at_launch_by_the_workers_own_parser(tmp_path, capsys):
    """`BATCH: x` is refused in one line before anything starts (it used to fail in every
    worker after launch)."""
    import yaml

    from launcher.cli import main as cli_main
    from launcher.pod.setup_init import init_pod
    pod = tmp_path / "pod"
    init_pod(pod, "tiny-cpu")
    stages_file = pod / "manifests" / "stages.yaml"
    doc = yaml.safe_load(stages_file.read_text())
    doc["stages"][1]["settings"]["BATCH"] = "x"
    stages_file.write_text(yaml.safe_dump(doc))
    assert cli_main(["--pod-dir", str(pod), "launch", "--stage", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "stage 1" in err and "BATCH must be an integer >= 1, got 'x'" in err
    assert not (pod / "logs" / "events.jsonl").exists()


def test_the_sync_section_is_parsed_once_per_value():
    from launcher.config.podconfig import PodConfig, SyncSettings
    config = PodConfig(sync={"interval": "30m"})
    first = config.sync_settings()
    assert config.sync_settings() is first          # not parsed again at every use
    config.sync["interval"] = "1h"                  # a changed value is parsed anew
    assert config.sync_settings() == SyncSettings(interval_s=3600.0)
    assert config.to_dict()["sync"] == {"interval": "1h"}     # the user's text, kept


def test_every_section_is_parsed_once_by_load_and_kept_typed(tmp_path, monkeypatch):
    """load_pod_config parses alerts/tracker/retention/sync/shards once; later uses get the
    same typed object, not a fresh parse of the raw mapping."""
    from launcher.config import alerts, podconfig, retention_settings, tracker
    init_pod(tmp_path, "tiny-cpu")
    path = tmp_path / "fractus-pod.yaml"
    path.write_text(path.read_text() + "alerts: {webhooks: [{format: ntfy, url_env: NTFY_URL}]}\n"
                                   "tracker: {kind: trackio, project: fractus-1b}\n"
                                   "retention: {keep: 3, budget: 800GB}\n")
    calls = []
    for module, cls in ((alerts, "AlertSettings"), (tracker, "TrackerSettings"),
                        (retention_settings, "RetentionSettings"), (podconfig, "SyncSettings")):
        parse = getattr(module, cls).parse.__func__
        monkeypatch.setattr(getattr(module, cls), "parse", classmethod(
            lambda c, *args, _p=parse: calls.append(c.__name__) or _p(c, *args)))
    config = load_pod_config(tmp_path)
    assert sorted(calls) == ["AlertSettings", "RetentionSettings", "SyncSettings",
                             "TrackerSettings"]
    def typed():
        return (config.alert_settings(), config.tracker_settings(),
                config.retention_settings(), config.sync_settings(), config.phases)
    first = typed()
    assert all(again is kept for again, kept in zip(typed(), first))
    assert len(calls) == 4                        # no parse at any later use
    assert first[0].webhooks[0].url_env == "NTFY_URL" and first[2].budget_bytes == 800 * 10**9
