"""`fractus-pod launch --stage N` on a pod at stage M < N runs the stage canary first.

Real processes: the launcher CLI as a child process, real tiny CPU workers. One pod is
trained 3 steps at stage 1 by the real launcher (once per session); each test works on a copy.
The wrong engine is the test-double kernel of tests/support/wrong_kernel.py (a sitecustomize on
PYTHONPATH registering an attention impl with a wrong normaliser), selected by the pod's
stage table for stage 2.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
from pathlib import Path

import psutil
import pytest
import yaml

from launcher.checks.trusted_loss import load_criteria_file
from launcher.errors import UserError
from launcher.config.devices import Slot
from launcher.config.podconfig import DEFAULT_MANIFESTS, load_pod_config
from launcher.worker.process import WorkerSpec, build_env
from tests.support.canary_pod import CANARY_STEPS, CRITERIA, fractus_pod, pod  # noqa: F401
from tests.support.e2e import (REPO, TEST_CRITERIA, TOKENS_PER_STEP, events_of, manifest_json,
                               wait_for, worker_records)
from tests.support.wrong_kernel import WRONG_KERNEL


def status_json(pod: Path) -> dict:
    done = fractus_pod(pod, "status", "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_switch_up_runs_the_canary_then_launches_at_the_new_stage(pod):
    done = fractus_pod(pod, "launch", "--stage", "2", "--gpus", "0", "--max-steps", "2")
    assert done.returncode == 0, done.stdout + done.stderr

    (canary,) = events_of(pod, "canary")
    assert canary["passed"] and canary["status"] == "Successful" and canary["exact"]
    assert (canary["from_stage"], canary["to_stage"], canary["gpu"]) == (1, 2, 0)
    assert len(canary["per_step"]) == CANARY_STEPS          # the pod's canary: section is read
    assert canary["start_token"] == 3 * TOKENS_PER_STEP            # from the stage-1 checkpoint
    # The canary ran before any worker of this launch; the workers then ran stage 2.
    (start,) = [e for e in events_of(pod, "worker_start") if e["ts"] > canary["ts"]]
    assert start["stage"] == 2
    assert manifest_json(pod)["gpu_0"]["stage"] == 2
    assert status_json(pod)["canary"]["status"] == "Successful"


def test_a_detached_switch_up_starts_its_workers_after_the_canary(pod):
    """--detach forks after the canary has started its children through the launcher's
    child spawner: the daemon must still start the workers (it used to wait for ever on
    the forked copy of the spawner, whose thread the fork does not carry)."""
    done = fractus_pod(pod, "launch", "--stage", "2", "--gpus", "0", "--max-steps", "2",
                       "--detach")
    assert done.returncode == 0, done.stdout + done.stderr
    daemon_pid = int(re.search(r"\(pid (\d+)\)", done.stdout).group(1))
    try:
        daemon = psutil.Process(daemon_pid)
        (canary,) = events_of(pod, "canary")
        assert canary["passed"]                 # the canary ran before the fork
        wait_for(lambda: not daemon.is_running() or daemon.status() == psutil.STATUS_ZOMBIE,
                 300, "the detached launcher to run its workers to the end")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(daemon_pid, signal.SIGKILL)
    (start,) = [e for e in events_of(pod, "worker_start") if e["ts"] > canary["ts"]]
    assert start["stage"] == 2
    (done_event,) = [e for e in worker_records(pod, 0, "done") if e["ts"] > start["ts"]]
    assert done_event["reason"] == "max_steps"
    assert manifest_json(pod)["gpu_0"]["stage"] == 2
    assert "pod DONE" in (pod / "logs" / "launcher.log").read_text()


def stage_2_runs_a_plugin_kernel(pod: Path, tmp_path: Path, source: str, impl: str) -> dict:
    """Stage 2 (still marked exact) selects `impl`, which `source` registers in every
    process started with the returned environment (a sitecustomize on PYTHONPATH)."""
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    (plugin / "sitecustomize.py").write_text(source)
    stages_file = pod / load_pod_config(pod).stages
    table = yaml.safe_load(stages_file.read_text())
    table["stages"][2]["settings"]["FRACTUS_ATTN_IMPL"] = impl
    stages_file.write_text(yaml.safe_dump(table))
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(plugin), os.environ.get("PYTHONPATH")) if p))


def switch_refused_by_the_canary(pod: Path, env: dict) -> tuple[str, dict]:
    """`launch --stage 2` whose canary refuses: its one stderr line (no traceback) and the
    canary event, once it is checked that nothing switched (manifest bytes, no worker started,
    no stage change)."""
    manifest_before = (pod / load_pod_config(pod).manifest).read_bytes()
    starts_before = len(events_of(pod, "worker_start"))

    done = fractus_pod(pod, "launch", "--stage", "2", "--gpus", "0", "--max-steps", "2", env=env)

    assert done.returncode == 1, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    (canary,) = events_of(pod, "canary")
    assert canary["status"] == "Failed"
    assert (pod / load_pod_config(pod).manifest).read_bytes() == manifest_before
    assert len(events_of(pod, "worker_start")) == starts_before
    assert not [e for e in events_of(pod, "stage_change") if e["ts"] > canary["ts"]]
    return line, canary


def test_a_wrong_stage_fails_the_canary_and_nothing_switches(pod, tmp_path):
    env = stage_2_runs_a_plugin_kernel(pod, tmp_path, WRONG_KERNEL, "halfcarry")
    line, canary = switch_refused_by_the_canary(pod, env)
    assert "canary FAILED" in line and "stays on stage 1" in line
    assert not canary["passed"]
    assert canary["reason"].startswith("step ") and canary["reason"] in line
    report = status_json(pod)
    assert report["stage"] == 1
    assert report["canary"]["status"] == "Failed"
    assert report["canary"]["reason"] == canary["reason"]
    human = fractus_pod(pod, "status").stdout
    assert "last canary" in human and "Failed" in human


# A kernel that does not fit: the step raises what CUDA raises when the card is full, so the
# worker's real out-of-memory path runs (oom event, exit 4) in a CPU test.
OOM_KERNEL = '''
import torch
from fractus.nn import attention


def does_not_fit(q, k, v, S0, z0):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has "
                                 "a total capacity of 139.72 GiB of which 1.20 GiB is free.")


attention.register_attention_impl("doesnotfit", does_not_fit)
'''


def test_out_of_memory_at_the_new_stage_is_refused_as_such(pod, tmp_path):
    env = stage_2_runs_a_plugin_kernel(pod, tmp_path, OOM_KERNEL, "doesnotfit")
    line, canary = switch_refused_by_the_canary(pod, env)
    assert "canary FAILED: stage 2 does not fit in memory: stage 2 ran out of memory at " \
           "step 4 (exit 4): CUDA out of memory. Tried to allocate 20.00 GiB" in line
    assert "the pod stays on stage 1 (nothing switched)" in line and "BATCH" in line
    assert canary["out_of_memory"]
    report = status_json(pod)
    assert report["stage"] == 1 and "ran out of memory" in report["canary"]["reason"]


def test_a_canary_that_cannot_judge_refuses_with_its_own_message(pod):
    stages_file = pod / load_pod_config(pod).stages
    table = yaml.safe_load(stages_file.read_text())
    table["stages"][1]["settings"]["FRACTUS_ATTN_IMPL"] = "nosuchkernel"   # reference can't run
    stages_file.write_text(yaml.safe_dump(table))
    manifest_before = (pod / load_pod_config(pod).manifest).read_bytes()

    done = fractus_pod(pod, "launch", "--stage", "2", "--gpus", "0", "--max-steps", "1")

    assert done.returncode == 1, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "canary INCONCLUSIVE" in line and "--no-canary" in line
    (canary,) = events_of(pod, "canary")
    assert canary["status"] == "Inconclusive" and "reference run failed" in canary["reason"]
    assert (pod / load_pod_config(pod).manifest).read_bytes() == manifest_before
    assert status_json(pod)["canary"]["status"] == "Inconclusive"


def test_no_canary_records_the_skip_and_switches(pod):
    done = fractus_pod(pod, "launch", "--stage", "2", "--gpus", "0", "--max-steps", "1",
                       "--no-canary")
    assert done.returncode == 0, done.stdout + done.stderr
    assert not events_of(pod, "canary")
    (skip,) = events_of(pod, "canary_skipped")
    assert (skip["from_stage"], skip["to_stage"], skip["reason"]) == (1, 2, "--no-canary")
    assert manifest_json(pod)["gpu_0"]["stage"] == 2
    assert status_json(pod)["canary"]["status"] == "skipped"


def test_same_stage_runs_no_canary(pod):
    done = fractus_pod(pod, "launch", "--stage", "1", "--gpus", "0", "--max-steps", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert not events_of(pod, "canary") and not events_of(pod, "canary_skipped")


def test_criteria_accept_canary_and_probe_sections_but_not_typos(tmp_path):
    path = tmp_path / "trusted_loss.yaml"
    path.write_text(yaml.safe_dump(CRITERIA))
    assert load_criteria_file(path).criteria.trend.lookback == \
        TEST_CRITERIA["checks"]["trend"]["lookback"]
    path.write_text(yaml.safe_dump({**CRITERIA, "canery": {"steps": 3}}))
    with pytest.raises(UserError, match="canery"):
        load_criteria_file(path)
    shipped = load_criteria_file(DEFAULT_MANIFESTS / "trusted_loss.yaml")
    settings = shipped.canary
    assert (settings.steps, settings.exact["cpu"].rtol, settings.exact["cuda"].rtol) == \
        (5, 1e-4, 2e-3)
    assert shipped.probe_tolerance.band == 0.25


def test_a_bad_canary_section_refuses_the_launch(pod):
    criteria = pod / load_pod_config(pod).criteria
    criteria.write_text(yaml.safe_dump({**CRITERIA, "canary": {"stpes": 3}}))
    done = fractus_pod(pod, "launch", "--stage", "2", "--gpus", "0")
    assert done.returncode == 2
    assert "stpes" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_worker_env_never_carries_hub_secrets(pod):
    config = load_pod_config(pod)
    base = dict(os.environ, HF_TOKEN="hf_secret", HUGGING_FACE_HUB_TOKEN="hf_secret2",
                HF_HUB_TOKEN_PATH="/x", PATH=os.environ.get("PATH", ""))
    env = build_env(config, WorkerSpec(Slot(0, "cpu"), {"BATCH": "2"}), base=base)
    assert not [k for k in env if k.startswith(("HF_", "HUGGING_FACE_"))]
    assert "hf_secret" not in json.dumps(env)
    assert env["PATH"] == base["PATH"] and env["BATCH"] == "2"
