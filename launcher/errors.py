"""Errors the CLI turns into one clear line and an exit code (no traceback), and `warn`: a
line on stderr that stops nothing."""

import importlib.metadata
import shlex
import sys


class UserError(Exception):
    """A mistake in the user's files, settings or command line: exit code 2, nothing started."""

    exit_code = 2


class Refused(Exception):
    """A judgement, not a mistake (e.g. the canary refused a switch): exit code 1, one line."""

    exit_code = 1


class PodBusy(UserError):
    """Another launcher holds the pod, or a worker already runs on a requested GPU."""


def install_hint(extra: str) -> str:
    """The command that installs optional `extra`'s requirements as the installed package
    declares them (fractus-pod is on no package index, so `fractus-pod[ray]` finds nothing)."""
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
    """UserError naming the known keys when `data` holds any other (a misspelling)."""
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise UserError(f"{where}: unknown key(s) {unknown}; known: {sorted(known)}")


def check_bool(value, where: str) -> bool:
    if not isinstance(value, bool):
        raise UserError(f"{where} must be true or false, got {value!r}")
    return value


def check_number(value, where: str, low, high, kind: str = "an integer", why: str = ""):
    """`value` if it is `kind` ("an integer", else any real) in [low, high] (NaN never is);
    else UserError naming the range and `why`."""
    integer = kind == "an integer"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) \
            or not low <= value <= high:
        low, high = (f"{x:g}" if isinstance(x, float) else x for x in (low, high))
        raise UserError(f"{where} must be {kind} from {low} to {high}{why}, got {value!r}")
    return value


def optional_section(data, known, where: str, shape: str) -> dict | None:
    """An optional pod config section: None if absent, else a mapping of `known` keys only
    (UserError showing `shape`, e.g. "like {keep: 3}")."""
    if data is None:
        return None
    if not isinstance(data, dict):
        raise UserError(f"{where} must be a mapping {shape}, got {data!r}")
    refuse_unknown_keys(data, known, where)
    return data


def warn(message: str) -> None:
    """One line on stderr; dropped, never raised, if it cannot be written (a full disk)."""
    try:
        print(f"fractus-pod: {message}", file=sys.stderr, flush=True)
    except OSError:
        pass
