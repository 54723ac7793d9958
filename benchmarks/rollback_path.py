"""The launcher files a NaN -> rollback crosses: tests/test_supervise_fake.py's NaN test (the
real Supervisor on the fake backend, tests/support/fake_backend.py) runs under
sys.setprofile, from the supervision step that reads the worker's `nan` event to the end of
that step (the GPU rolled back to its passed checkpoint, the pod a stage down, the workers
started again); the distinct launcher/ files whose functions ran are listed.

    python -m benchmarks.rollback_path                 # the working tree
    python -m benchmarks.rollback_path --rev 786783c   # a commit, unpacked by `git archive`

Results: docs/BENCHMARKS.md, "Code shape".
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEST = ("tests/test_supervise_fake.py::"
        "test_nan_rolls_the_gpu_back_to_its_passed_checkpoint_and_the_pod_down_a_stage")


def trace(root: Path) -> None:
    """In a process whose sys.path starts at `root`: run the test, print the files."""
    import pytest

    from launcher.supervise.supervisor import Supervisor
    from tests.support.fake_backend import FakeBackend

    launcher_dir = str(root / "launcher") + os.sep
    files: set[str] = set()
    window = {"armed": False, "done": False}
    event, step = FakeBackend.event, Supervisor.step

    def traced_event(self, gpu, name, **fields):
        window["armed"] |= name == "nan" and not window["done"]
        return event(self, gpu, name, **fields)

    def profile(frame, what, arg):
        if what == "call" and frame.f_code.co_filename.startswith(launcher_dir):
            files.add(frame.f_code.co_filename[len(launcher_dir):])

    def traced_step(self, *args, **kwargs):
        if not window["armed"] or window["done"]:
            return step(self, *args, **kwargs)
        sys.setprofile(profile)
        try:
            return step(self, *args, **kwargs)
        finally:
            sys.setprofile(None)
            window["done"] = True

    FakeBackend.event, Supervisor.step = traced_event, traced_step
    code = pytest.main(["-q", "-p", "no:cacheprovider", str(root / TEST)])
    if code != 0 or not files:
        sys.exit(f"the NaN test failed or traced nothing (pytest exit {code})")
    print(f"\n{len(files)} launcher files from the nan event to the rollback's end:")
    for name in sorted(files):
        print(f"  launcher/{name}")


def run_in(root: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(root)}
    subprocess.run([sys.executable, __file__, "--trace", str(root)], cwd=root, env=env,
                   check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", help="a git revision (default: the working tree)")
    parser.add_argument("--trace", help=argparse.SUPPRESS)     # the child: its root
    args = parser.parse_args()
    if args.trace:
        sys.path.insert(0, args.trace)
        trace(Path(args.trace))
    elif args.rev is None:
        run_in(REPO)
    else:
        with tempfile.TemporaryDirectory(prefix="rollback-path-") as tmp:
            archive = subprocess.run(["git", "archive", args.rev], cwd=REPO, check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            run_in(Path(tmp))


if __name__ == "__main__":
    main()
