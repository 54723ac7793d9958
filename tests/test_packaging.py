"""An installed fractus-pod sets up and runs a pod with nothing of the checkout: the shipped
stage and criteria files are package data, the worker is a module of the package, the wheel
carries the licence and the version; and `init` writes a whole pod or nothing.

Real components: the wheel pip builds from a copy of the sources, installed into a venv that
sees the system's dependencies (torch...) but runs from another folder with PYTHONPATH unset;
`fractus-pod` as a child process.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from fractus import __version__
from launcher.errors import install_hint
from tests.support.e2e import REPO

SOURCES = ("pyproject.toml", "README.md", "LICENSE", "fractus", "launcher")


def run(*args, cwd: Path, env: dict | None = None, timeout: float = 300):
    return subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL,
                          env={**os.environ, **(env or {})})


def one_error_line(done) -> str:
    """A user mistake: exit 2, one line on stderr, no traceback."""
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


def tree(path: Path) -> dict[str, bytes | None]:
    """Every entry under `path` (hidden ones included): files with their bytes."""
    return {p.relative_to(path).as_posix(): (p.read_bytes() if p.is_file() else None)
            for p in sorted(path.rglob("*"))}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel pip builds from the sources the repository tracks (a copy: no build/ of an
    earlier build can leak into it)."""
    root = tmp_path_factory.mktemp("wheel")
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", *SOURCES],
                            cwd=REPO, capture_output=True, text=True, check=True).stdout
    for rel in listed.split():
        if (REPO / rel).is_file():
            (root / "src" / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, root / "src" / rel)
    done = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
               "-q", "-w", root / "dist", root / "src", cwd=root)
    assert done.returncode == 0, done.stdout + done.stderr
    (built,) = (root / "dist").glob("fractus_pod-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A venv with the wheel installed (its dependencies from the system's site-packages)."""
    root = tmp_path_factory.mktemp("venv")
    done = run(sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
               root, cwd=root)
    assert done.returncode == 0, done.stderr
    python = root / "bin" / "python"
    done = run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
               "--ignore-installed", wheel, cwd=root)
    assert done.returncode == 0, done.stdout + done.stderr
    return root


def elsewhere(venv: Path, tmp_path: Path):
    """Run the venv's `fractus-pod` from `tmp_path`, far from the checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FRACTUS_POD_DIR")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"

    def fractus_pod(*args, timeout: float = 300):
        return subprocess.run(["fractus-pod", *map(str, args)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    return fractus_pod, env


def test_the_wheel_carries_the_defaults_the_worker_the_licence_and_the_version(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"launcher/config/defaults/stages.yaml",
            "launcher/config/defaults/trusted_loss.yaml",
            "fractus/train/worker.py", "launcher/dashboard/static/index.html"} <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), sorted(names)
    assert wheel.name.startswith(f"fractus_pod-{__version__}-")


def test_an_installed_wheel_sets_up_a_pod_and_runs_its_worker_from_another_folder(
        venv, tmp_path):
    fractus_pod, env = elsewhere(venv, tmp_path)
    # The venv's own copy answers, not the checkout (its editable install is in the
    # system's site-packages the venv also sees).
    where = subprocess.run([venv / "bin" / "python", "-c",
                            "import launcher, fractus.train.worker as w; "
                            "print(launcher.__file__); print(w.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    assert all(Path(line).is_relative_to(venv) for line in where.stdout.split()), where.stdout
    done = fractus_pod("--pod-dir", "p", "init", "--preset", "tiny-cpu")
    assert done.returncode == 0, done.stdout + done.stderr
    version = fractus_pod("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"fractus-pod {__version__}"
    pod = tmp_path / "p"
    shipped = venv.glob("lib/python*/site-packages/launcher/config/defaults/stages.yaml")
    assert (pod / "manifests" / "stages.yaml").read_text() == next(shipped).read_text()
    assert (pod / "data" / "shard_phase2_gpu0.npy").is_file()
    # The launch reads the shipped criteria for their defaults and starts the package's
    # worker module; two steps on GPU 0, a clean end.
    launched = fractus_pod("--pod-dir", "p", "launch", "--stage", "3", "--gpus", "0",
                           "--max-steps", "2", timeout=600)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    assert "DONE" in launched.stdout
    status = fractus_pod("--pod-dir", "p", "status", "--json")
    assert status.returncode == 0, status.stderr


def test_init_refused_on_a_clash_leaves_the_pod_as_it_was(tmp_path):
    pod = tmp_path / "pod"
    pod.mkdir()
    (pod / "logs").write_text("a file where init puts a folder\n")
    before = tree(pod)
    line = one_error_line(run(sys.executable, "-m", "launcher.cli", "--pod-dir", pod, "init",
                              cwd=REPO))
    assert str(pod / "logs") in line and "init wrote nothing" in line
    assert tree(pod) == before
    # Fixed as the line says, the same command makes the whole pod.
    (pod / "logs").unlink()
    done = run(sys.executable, "-m", "launcher.cli", "--pod-dir", pod, "init", cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert (pod / "fractus-pod.yaml").is_file() and (pod / "data").is_dir()


def test_init_that_fails_midway_creates_nothing(tmp_path):
    """A new pod two folders deep whose last name the file system refuses (too long): before
    the first folder is made, nothing fails; after it, nothing may remain."""
    pod = tmp_path / "new" / ("x" * 300)
    line = one_error_line(run(sys.executable, "-m", "launcher.cli", "--pod-dir", pod, "init",
                              "--no-data", cwd=REPO))
    assert "init wrote nothing" in line and "File name too long" in line
    assert tree(tmp_path) == {}


@pytest.mark.parametrize("extra", ["ray", "tracker"])
def test_a_missing_extra_is_named_with_a_command_that_installs_it(extra):
    """fractus-pod is on no index: the hint installs the extra's own requirements, those
    pyproject.toml declares for it."""
    words = shlex.split(install_hint(extra))
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = {re.match(r"[\w.-]+", r).group() for r in declared["optional-dependencies"][extra]}
    assert words[:2] == ["pip", "install"] and len(words) > 2, words
    assert {re.match(r"[\w.-]+", w).group() for w in words[2:]} == names


def test_the_script_run_by_hand_and_the_module_the_launcher_starts_are_one_program(
        venv, tmp_path):
    """scripts/fast4gpu_boost_v2.py (a checkout) and `python -m fractus.train.worker` (what
    the launcher starts, the only entry of an installed wheel) answer alike."""
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "MODEL": "tiny",
           "DEVICE": "cpu", "GPU_ID": "0", "SHARD": str(tmp_path / "absent.npy")}
    answers = [subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300, stdin=subprocess.DEVNULL)
               for command in ([sys.executable, "-u", REPO / "scripts" / "fast4gpu_boost_v2.py"],
                               [sys.executable, "-u", "-m", "fractus.train.worker"],
                               [venv / "bin" / "python", "-u", "-m", "fractus.train.worker"])]
    assert answers[0].returncode == 2 and "shard not found" in answers[0].stderr
    assert {(a.returncode, a.stderr) for a in answers} == {(2, answers[0].stderr)}
