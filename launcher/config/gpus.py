"""The machine's CUDA devices, counted before any worker starts.

Two witnesses, because either can fail where the other works: nvidia-smi (absent in many
containers) and the workers' torch (a CPU-only build sees no GPU whatever nvidia-smi says).
torch is asked in a child with CUDA_VISIBLE_DEVICES removed, so indices are the machine's.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from dataclasses import dataclass

from launcher import child
from launcher.errors import UserError

NVIDIA_SMI_TIMEOUT_S = 20
TORCH_PROBE_TIMEOUT_S = 120      # a cold import of torch with CUDA can take a while
# A worker's view: devices torch can use (0 when CUDA is not available at all).
TORCH_PROBE = ("import torch; print(torch.cuda.device_count() "
               "if torch.cuda.is_available() else 0)")


@dataclass(frozen=True)
class SmiReport:
    count: int | None      # GPUs nvidia-smi lists; None when it could not say
    problem: str           # why not (absent, its failure's first line, hung); "" when fine


@functools.lru_cache(maxsize=1)
def nvidia_smi() -> SmiReport:
    if shutil.which("nvidia-smi") is None:
        return SmiReport(None, "nvidia-smi not found")
    try:
        done = subprocess.run(["nvidia-smi", "-L"], env=child.child_env(), capture_output=True,
                              text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return SmiReport(None, f"nvidia-smi did not answer in {NVIDIA_SMI_TIMEOUT_S} s")
    except OSError as exc:
        return SmiReport(None, f"nvidia-smi failed to run: {exc}")
    if done.returncode != 0:
        said = next((s.strip() for s in (done.stdout + done.stderr).splitlines() if s.strip()),
                    "no output")
        return SmiReport(None, f"nvidia-smi failed (exit {done.returncode}): {said[:160]}")
    return SmiReport(sum(1 for s in done.stdout.splitlines() if s.startswith("GPU ")), "")


@functools.lru_cache(maxsize=1)
def torch_cuda_count() -> int | None:
    """CUDA devices the workers' torch can use, or None when the probe itself failed."""
    env = child.child_env()
    env.pop("CUDA_VISIBLE_DEVICES", None)
    try:
        done = subprocess.run(child.python_command("-c", TORCH_PROBE), env=env,
                              capture_output=True, text=True, timeout=TORCH_PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.split()
    return int(lines[-1]) if done.returncode == 0 and lines and lines[-1].isdigit() else None


def visible_gpu_count() -> int:
    """For `auto` and a bare `cuda`: nvidia-smi's count, else torch's, else 0."""
    report = nvidia_smi()
    if report.count is not None:
        return report.count
    return torch_cuda_count() or 0


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (short, however many GPUs are named)."""
    out, run = [], []
    for i in sorted(indices):
        if run and i != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(i)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def check_cuda_present(gpus: list[int], devices: str) -> None:
    """Refuse CUDA GPUs torch does not see (one line, exit 2); silent if its probe failed."""
    if not gpus:
        return
    have = torch_cuda_count()
    if have is None:
        return
    missing = [g for g in gpus if g >= have]
    if not missing:
        return
    smi = nvidia_smi()
    witness = f"nvidia-smi lists {smi.count}" if smi.count is not None else smi.problem
    sees = (f"torch sees {have} GPU(s) (0-{have - 1})" if have else
            "torch sees no CUDA device (torch.cuda.is_available() is False)")
    raise UserError(f"devices {devices!r} asks for GPU(s) {_ranges(gpus)} but this machine has "
                    f"no GPU {_ranges(missing)}: {sees}; {witness}. Set `devices:` in "
                    f"fractus-pod.yaml (or --devices) to GPUs it has, or cpu:N")
