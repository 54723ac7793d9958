"""Every child the launcher starts (launcher.child): fractus-pod's engine whatever the cwd (a
decoy `fractus/` package sits in the pod directory), a scrubbed environment read from
/proc/PID/environ, and no child outliving a kill -9 of its launcher; a worker whose launcher
dies gets its parent-death SIGTERM repeated (once per launcher thread) and still writes its
final checkpoint.

The first two tests use a real stand-in process that runs the launcher's own spawning code
(launcher.checks.probe_check.run_probe_process from a probe thread, launcher.child.spawn for a
worker) beside idle threads, as the real launcher's probe and sync threads, so the probe
runs long and the repeated SIGTERM is certain; the third kills the real launcher while one
of its probe threads waits on a probe child.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from launcher.child import child_env, resolve_command
from tests.support.pods import copy_pod
from tests.support.v1_run import add_decoy_package
from tests.support.e2e import (SEQ, TEST_CRITERIA, Launcher, events_of, launchers,
                               make_pod, wait_for, worker_records)

__all__ = ["launchers"]   # the fixture, imported for pytest
from tests.support.worker_utils import (REPO_ROOT, events, read_jsonl, worker_env,
                                        write_synth_shard)

SECRET = "hf_secret_value_for_the_scrub_test"
# Secrets no name list guessed (issue 16 item 16): only an allow-list keeps them out.
UNNAMED_SECRETS = {"AWS_SESSION_TOKEN": "aws-session-secret", "NPM_TOKEN": "npm-secret",
                   "DATABASE_URL": "postgres://user:db-password-secret@db.example:5432/app"}


def environ_of(pid: int) -> dict[str, str]:
    """A live process's environment as the kernel holds it (what any same-user process reads)."""
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in entries if b"=" in entry)


def assert_no_secret(environ: dict[str, str]) -> None:
    assert not {"HF_TOKEN", "GITHUB_TOKEN", *UNNAMED_SECRETS} & set(environ), sorted(environ)
    text = "\0".join(environ.values())
    assert SECRET not in text and not [v for v in UNNAMED_SECRETS.values() if v in text]


def start_stand_in(script: str, cwd: Path, env: dict) -> subprocess.Popen:
    """A launcher stand-in: idle threads (like probe/sync threads), then `script`."""
    prelude = textwrap.dedent("""
        import sys, threading, time
        for n in range(3):
            threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    """)
    return subprocess.Popen([sys.executable, "-c", prelude + textwrap.dedent(script)],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def child_running(parent: psutil.Process, marker: str) -> psutil.Process | None:
    for proc in parent.children(recursive=True):
        try:
            if marker in " ".join(proc.cmdline()):
                return proc
        except psutil.Error:
            continue
    return None


def gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def cleanup():
    procs: list[int] = []
    yield procs
    for pid in procs:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def test_child_env_passes_only_allowed_names():
    base = {**UNNAMED_SECRETS, "HF_TOKEN": SECRET, "PATH": "/bin", "HOME": "/root",
            "LC_ALL": "C", "OMP_NUM_THREADS": "1", "NCCL_DEBUG": "INFO",
            "TORCHINDUCTOR_CACHE_DIR": "/tmp/x", "BATCH": "2", "NCCL_IB_PASSWORD": "x",
            "MY_TRACKER_URL": "u", "CUSTOM_KEY": "k"}
    env = child_env(base)
    assert set(env) == {"PATH", "HOME", "LC_ALL", "OMP_NUM_THREADS", "NCCL_DEBUG",
                        "TORCHINDUCTOR_CACHE_DIR", "BATCH"}
    # What the pod config names passes, a secret-like name too (the user said so); the
    # hub's never.
    kept = child_env(base, keep={"MY_TRACKER_URL", "CUSTOM_KEY", "HF_TOKEN"})
    assert {"MY_TRACKER_URL", "CUSTOM_KEY"} <= set(kept) and "HF_TOKEN" not in kept


def test_probe_child_imports_our_engine_gets_no_secret_and_dies_with_its_launcher(
        tmp_path, cleanup, worker_trained_pod):
    pod = copy_pod(worker_trained_pod, tmp_path / "pod")
    add_decoy_package(pod)
    env = dict(os.environ, HF_TOKEN=SECRET, GITHUB_TOKEN=SECRET,
               PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))

    # First a probe run to its end: it imports fractus-pod's engine despite the decoy.
    done = start_stand_in(f"""
        from launcher.checks.probe_check import run_probe_process
        print(run_probe_process({str(pod / "checkpoints/fractus_1b_gpu0.pt")!r},
                                {str(pod / "data/shard_phase2_gpu0.npy")!r},
                                rows=2, cwd={str(pod)!r}, timeout_s=300))
    """, REPO_ROOT, env)
    cleanup.append(done.pid)
    out, err = done.communicate(timeout=300)
    assert done.returncode == 0, err
    assert "'ar':" in out

    # Then a long probe from a probe thread: its environment, then kill -9 of its launcher.
    stand_in = start_stand_in(f"""
        import threading
        from launcher.checks.probe_check import run_probe_process
        def probe():
            run_probe_process({str(pod / "checkpoints/fractus_1b_gpu0.pt")!r},
                              {str(pod / "data/shard_phase2_gpu0.npy")!r},
                              rows=100000, cwd={str(pod)!r}, timeout_s=3600)
        threading.Thread(target=probe, name="probe-gpu0", daemon=True).start()
        time.sleep(3600)
    """, REPO_ROOT, env)
    cleanup.append(stand_in.pid)
    probe = wait_for(lambda: child_running(psutil.Process(stand_in.pid), "fractus.eval.probe"),
                     60, "the probe child")
    environ = Path(f"/proc/{probe.pid}/environ").read_bytes().split(b"\0")
    names = {entry.split(b"=", 1)[0].decode() for entry in environ if entry}
    assert "HF_TOKEN" not in names and "GITHUB_TOKEN" not in names
    assert SECRET.encode() not in b"\0".join(environ)
    assert "PYTHONPATH" in names                   # the rest of the environment is kept
    assert "-P" in probe.cmdline()

    stand_in.kill()
    stand_in.wait()
    wait_for(lambda: gone(probe), 15, "the probe to die with its launcher")


def test_worker_writes_its_final_checkpoint_through_repeated_parent_death_signals(
        tmp_path, cleanup):
    pod = tmp_path / "pod"
    pod.mkdir()
    add_decoy_package(pod)
    write_synth_shard(tmp_path / "shard.npy", tokens=400_000)
    env = worker_env(tmp_path, SAVE_EVERY=0, HF_TOKEN=SECRET, ALLOW_FRESH_START=1)
    stand_in = start_stand_in(f"""
        import signal
        from launcher import child
        proc = child.spawn(["python", "-u", "-m", "fractus.train.worker"], cwd={str(pod)!r},
                           env=dict(__import__("os").environ),
                           stdout=open({str(tmp_path / "worker.log")!r}, "ab"),
                           stderr=subprocess.STDOUT, death_signal=signal.SIGTERM)
        print(proc.pid, flush=True)
        time.sleep(3600)
    """.replace("import signal", "import signal, subprocess"), REPO_ROOT, env)
    cleanup.append(stand_in.pid)
    worker_pid = int(stand_in.stdout.readline())
    cleanup.append(worker_pid)
    metrics = tmp_path / "metrics.jsonl"
    wait_for(lambda: any(r.get("type") == "metrics" for r in read_jsonl(metrics)), 120,
             "the worker's first step")
    worker = psutil.Process(worker_pid)
    assert "HF_TOKEN" not in worker.environ()

    stand_in.kill()                      # kill -9 the launcher: the kernel's SIGTERM(s) follow
    stand_in.wait()
    # The kernel repeats the parent-death signal once per launcher thread that exits; make
    # sure repeats land while the worker finishes its step and saves.
    while not gone(worker):
        try:
            worker.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.01)

    records = read_jsonl(metrics)
    (done,) = events(records, "done")
    assert done["reason"] == "signal"
    final = events(records, "checkpoint")[-1]
    assert final["next_token"] == done["next_token"]
    assert Path(final["path"]).exists()
    assert (tmp_path / "worker.log").read_text().count("decoy") == 0


def test_killed_launcher_with_a_probe_running_every_worker_checkpoints_and_the_probe_dies(
        tmp_path, launchers, monkeypatch):
    """The real launcher, killed -9 while a probe thread waits on its probe child: every
    worker writes its final checkpoint, the probe (which never saw a secret) dies too. The
    children get only allowed names: secrets nobody listed stay out, the system's and the
    pod config's names (`env:`, `pass_env:`) pass."""
    monkeypatch.setenv("HF_TOKEN", SECRET)                 # the launcher's own environment
    for name, value in {**UNNAMED_SECRETS, "GITHUB_TOKEN": SECRET}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MY_TRACKER_URL", "http://tracker.local")     # pass_env: names it
    monkeypatch.setenv("LC_TIME", "C.UTF-8")
    criteria = {**TEST_CRITERIA, "probe": {"every": 1, "relativeBand": 100.0, "parallel": 1,
                                           "timeout_s": 600}}
    pod = make_pod(tmp_path, criteria, pass_env=["MY_TRACKER_URL"])
    add_decoy_package(pod)
    launcher = Launcher(pod, "--stage", "1")
    launchers.append(launcher)
    for gpu in (0, 1):
        wait_for(lambda: worker_records(pod, gpu, "checkpoint"), 120, "checkpoints")
    probe = wait_for(lambda: child_running(psutil.Process(launcher.proc.pid),
                                           "fractus.eval.probe"), 120, "a probe child")
    assert "-P" in probe.cmdline()
    probe_env = environ_of(probe.pid)
    assert_no_secret(probe_env)
    assert probe_env["LC_TIME"] == "C.UTF-8" and "PATH" in probe_env
    workers = [psutil.Process(e["pid"]) for e in events_of(pod, "worker_start")]
    for worker in workers:
        worker_env_now = environ_of(worker.pid)
        assert_no_secret(worker_env_now)
        assert worker_env_now["MY_TRACKER_URL"] == "http://tracker.local"
        assert worker_env_now["LC_TIME"] == "C.UTF-8" and "PATH" in worker_env_now
        assert worker_env_now["SEQ"] == str(SEQ)              # the pod config's env:
    killed_at = time.time()
    launcher.proc.kill()
    launcher.proc.wait()
    # A probe just started runs for seconds more (torch import, model load); it must not.
    wait_for(lambda: gone(probe), 3, "the probe to die with its launcher")
    wait_for(lambda: all(gone(w) for w in workers), 60, "the workers to stop with it")
    for gpu in (0, 1):
        (done,) = worker_records(pod, gpu, "done")
        final = worker_records(pod, gpu, "checkpoint")[-1]
        assert done["reason"] == "signal" and final["ts"] > killed_at
        assert final["next_token"] == done["next_token"]


def test_configured_python_commands_run_safe_path_and_env_is_scrubbed():
    assert resolve_command(["python", "-u", "-m", "fractus.train.worker"]) == \
        [sys.executable, "-P", "-u", "-m", "fractus.train.worker"]
    assert resolve_command(["torchrun", "x.py"]) == ["torchrun", "x.py"]
    env = child_env({"HF_TOKEN": "t", "HUGGING_FACE_HUB_TOKEN": "t", "HF_ENDPOINT": "u",
                     "WANDB_API_KEY": "k", "START_TOKEN": "64", "FORCE_START_TOKEN": "1",
                     "PATH": "/bin"})
    assert env == {"START_TOKEN": "64", "FORCE_START_TOKEN": "1", "PATH": "/bin"}


def test_nvidia_smi_queries_get_the_scrubbed_environment(tmp_path, monkeypatch):
    """The launcher's other children (nvidia-smi, here a stand-in on PATH that records its
    environment) get no secret either."""
    from launcher.config.devices import _visible_gpu_count
    from launcher.worker.process import busy_cuda_gpus
    seen = tmp_path / "environ"
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\necho CALLED >> {seen}\nenv >> {seen}\necho 'GPU 0: stand-in (UUID: GPU-0)'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("HF_TOKEN", SECRET)
    assert _visible_gpu_count() == 1
    busy_cuda_gpus([0])
    recorded = seen.read_text()
    assert recorded.count("CALLED") == 3 and SECRET not in recorded
