"""Every process the launcher starts (workers, probes, canary workers) is started here, with
three guarantees (docs/LAUNCHER.md, Commands): safe-path Python (`-P`, so a user's own
`fractus/` is never imported), an allow-listed environment (`child_env`; a child's environment
is readable by any process of the user, so the hub's settings never pass), and death with the
launcher (`PR_SET_PDEATHSIG`: SIGTERM for workers, SIGKILL for the rest).

The kernel sends the parent-death signal when the *thread* that forked the child exits, so
every child is forked from one long-lived thread (`_SPAWNER`), recreated after each fork
(`launch --detach`). Between fork and exec the child calls only `prctl`, resolved at import:
`dlopen` there can deadlock on a lock another thread held at the fork.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Collection, Mapping, Sequence

from fractus.train.env import ENV_VARS, PARENT_DEATH_ENV

PR_SET_PDEATHSIG = 1
# The hub's settings and token: never in a child, whatever names them.
HUB_ENV_PREFIXES = ("HF_", "HUGGING_FACE_")
# Names that look like a secret: dropped even inside an allowed family (NCCL_..._PASSWORD),
# unless the pod config names them. Not a bare "TOKEN": START_TOKEN is a worker setting.
SECRET_ENV_PARTS = ("SECRET", "PASSWORD", "API_KEY", "ACCESS_KEY", "AUTH_TOKEN",
                    "ACCESS_TOKEN", "API_TOKEN", "SESSION_TOKEN", "CREDENTIAL")
SECRET_ENV_NAMES = ("GITHUB_TOKEN", "GH_TOKEN")

# What a child may inherit besides the worker contract (ENV_VARS).
SYSTEM_ENV_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "HOSTNAME", "TERM", "TZ", "LANG",
    "LANGUAGE", "TMPDIR", "TEMP", "TMP", "XDG_CACHE_HOME", "XDG_RUNTIME_DIR",
    "LD_LIBRARY_PATH", "VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONPATH", "PYTHONHOME",
    "PYTHONUNBUFFERED", "PYTHONIOENCODING", "PYTHONHASHSEED", "PYTHONFAULTHANDLER",
    "PYTHONDONTWRITEBYTECODE", "PYTHONWARNINGS", "PYTHONUTF8", "PYTHONMALLOC",
    PARENT_DEATH_ENV})
SYSTEM_ENV_PREFIXES = (
    "LC_", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "GOTO_", "BLIS_",             # locale, threads
    "CUDA_", "CUDNN_", "CUBLAS", "NCCL_", "NVIDIA_", "NV_", "GLOO_",          # GPUs
    "TORCH", "PYTORCH_", "TRITON_",                           # TORCH_*, TORCHINDUCTOR_*, ...
    "FRACTUS_")                                                             # our own
INTERPRETER_NAMES = ("python", "python3")

# Starting a process takes milliseconds; a minute means the spawner thread is gone.
SPAWN_TIMEOUT_S = 60.0


def _new_spawner() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="child-spawner")


def _respawner_after_fork() -> None:
    # The forked copy believes its absent thread idle; dropped, not shut down (that would
    # join a thread that does not exist here).
    global _SPAWNER
    _SPAWNER = _new_spawner()


_SPAWNER = _new_spawner()
os.register_at_fork(after_in_child=_respawner_after_fork)


def _load_prctl():
    """libc's prctl, resolved in the launcher (never between fork and exec); None off Linux."""
    if sys.platform != "linux":
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes, prctl.restype = [ctypes.c_int, ctypes.c_ulong], ctypes.c_int
    return prctl


_PRCTL = _load_prctl()


def python_command(*args: str) -> list[str]:
    """This interpreter in safe-path mode, with `args` (e.g. "-m", "fractus.eval.probe")."""
    return [sys.executable, "-P", *args]


def resolve_command(command: Sequence[str]) -> list[str]:
    """`command` with a leading `python` replaced by this interpreter in safe-path mode."""
    command = list(command)
    if command and command[0] in (*INTERPRETER_NAMES, sys.executable):
        rest = command[1:]
        return python_command(*(rest[1:] if rest[:1] == ["-P"] else rest))
    return command


def is_hub_name(name: str) -> bool:
    return name.upper().startswith(HUB_ENV_PREFIXES)


def is_secret_name(name: str) -> bool:
    upper = name.upper()
    return (is_hub_name(name) or upper in SECRET_ENV_NAMES
            or any(part in upper for part in SECRET_ENV_PARTS))


def is_allowed_name(name: str, keep: Collection[str] = ()) -> bool:
    """Whether a child may get variable `name`; `keep`: the names the pod config gives."""
    if is_hub_name(name):
        return False
    if name in keep:
        return True
    known = name in ENV_VARS or name in SYSTEM_ENV_NAMES or name.startswith(SYSTEM_ENV_PREFIXES)
    return known and not is_secret_name(name)


def child_env(base: Mapping[str, str] | None = None, keep: Collection[str] = (),
              **overrides: str) -> dict[str, str]:
    """`base` (default: the launcher's environment) plus `overrides`, allowed names only: the
    one scrub of every child's environment, here and on a Ray node."""
    env = dict(os.environ if base is None else base)
    env.update(overrides)
    return {name: value for name, value in env.items() if is_allowed_name(name, keep)}


def _die_with_parent(parent_pid: int, death_signal: int):
    """Runs in the child before exec: `death_signal` when the launcher dies (exit if it has)."""
    def hook():
        _PRCTL(PR_SET_PDEATHSIG, death_signal)
        if os.getppid() != parent_pid:
            os._exit(1)
    return hook


def spawn(command: Sequence[str], *, cwd, env: Mapping[str, str], keep: Collection[str] = (),
          stdout: int | IO | None = subprocess.DEVNULL, stderr: int | IO | None = None,
          death_signal: int = signal.SIGKILL, new_session: bool = True) -> subprocess.Popen:
    """Start `command` with `env` scrubbed, from the spawner thread. `new_session`: its own
    process group (Ctrl-C reaches only the launcher; killpg reaches a child's helpers)."""
    env = child_env(env, keep)
    if death_signal == signal.SIGTERM:
        env[PARENT_DEATH_ENV] = "SIGTERM"
    preexec = _die_with_parent(os.getpid(), death_signal) if _PRCTL is not None else None
    argv = resolve_command(command)

    def start() -> subprocess.Popen:
        return subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=stdout,
                                stderr=stderr, start_new_session=new_session,
                                preexec_fn=preexec)
    try:
        return _SPAWNER.submit(start).result(timeout=SPAWN_TIMEOUT_S)
    except TimeoutError:
        raise TimeoutError(f"could not start {argv[0]} within {SPAWN_TIMEOUT_S:g}s: the "
                           f"launcher's child-spawner thread is not running") from None


def run(command: Sequence[str], *, cwd, env: Mapping[str, str],
        timeout_s: float) -> subprocess.CompletedProcess:
    """spawn() and wait, capturing text; on timeout: SIGKILL the group, raise TimeoutExpired."""
    proc = spawn(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except BaseException:
        kill_group(proc)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode,
                                       out.decode(errors="replace"), err.decode(errors="replace"))


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group (it runs in its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
