"""Errors the CLI turns into one clear line and an exit code (no traceback), and `warn`: a
line on stderr that stops nothing."""

import importlib.metadata
import shlex
import sys


class UserError(Exception):
    """A mistake in the user's files, settings or command line: exit code 2, nothing started."""

    exit_code = 2


class Refused(Exception):
    """A judgement, not a mistake: the pod refuses to go on (e.g. the stage canary refused
    the switch). Exit code 1, one line, nothing switched."""

    exit_code = 1


class PodBusy(UserError):
    """Another launcher holds the pod, or a worker already runs on a requested GPU."""


def install_hint(extra: str) -> str:
    """The command that installs what fractus-pod's optional `extra` needs, as the installed
    package declares it (fractus-pod is on no package index: `pip install
    'fractus-pod[ray]'` would find nothing)."""
    try:
        declared = importlib.metadata.requires("fractus-pod") or []
    except importlib.metadata.PackageNotFoundError:
        declared = []
    wanted = [r.split(";")[0].strip() for r in declared
              if r.split(";")[1:] and r.split(";")[1].strip() == f'extra == "{extra}"']
    if not wanted:
        return f"pip install -e '.[{extra}]' in the fractus-pod checkout"
    return "pip install " + " ".join(shlex.quote(r) for r in wanted)


def refuse_unknown_keys(data, known, where: str) -> None:
    """A mapping from the user's YAML may hold only `known` keys: a misspelt one is named
    with the keys that exist (exit 2), never silently ignored."""
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise UserError(f"{where}: unknown key(s) {unknown}; known: {sorted(known)}")


def check_bool(value, where: str) -> bool:
    if not isinstance(value, bool):
        raise UserError(f"{where} must be true or false, got {value!r}")
    return value


def check_number(value, where: str, low, high, kind: str = "an integer", why: str = ""):
    """`value` when it is `kind` ("an integer", else any real number) from `low` to `high`
    (NaN never is); else one line naming the value, the range and `why` it has one."""
    integer = kind == "an integer"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) \
            or not low <= value <= high:
        low, high = (f"{x:g}" if isinstance(x, float) else x for x in (low, high))
        raise UserError(f"{where} must be {kind} from {low} to {high}{why}, got {value!r}")
    return value


def optional_section(data, known, where: str, shape: str) -> dict | None:
    """An optional section of the pod config (`alerts:`, `data:`, `retention:`, `tracker:`):
    None when absent; otherwise a mapping of `known` keys only, else one line naming the
    value with the expected `shape` (e.g. "like {keep: 3}")."""
    if data is None:
        return None
    if not isinstance(data, dict):
        raise UserError(f"{where} must be a mapping {shape}, got {data!r}")
    refuse_unknown_keys(data, known, where)
    return data


def warn(message: str) -> None:
    """One line on the launcher's stderr, which may itself be a log on a full disk: a line
    that cannot be written is dropped, never raised."""
    try:
        print(f"fractus-pod: {message}", file=sys.stderr, flush=True)
    except OSError:
        pass
