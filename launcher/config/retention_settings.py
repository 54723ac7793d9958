"""`retention:` of the pod config: how much of the run the hub keeps (docs/LAUNCHER.md,
Bounded storage on the hub). No `retention:` keeps every push.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from launcher.errors import UserError, check_bool, check_number, optional_section

KEEP_RANGE = (1, 1000)
BUDGET_RANGE = (64 << 10, 1 << 60)           # 64 KiB .. 1 EiB
_PIN = re.compile(r"^[0-9a-f]{7,64}$")
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGTP]?i?B)\s*$", re.IGNORECASE)
_UNIT = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15,
         "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40, "PIB": 1 << 50}


@dataclass(frozen=True)
class RetentionSettings:
    keep: int
    milestones: bool = True
    pins: tuple[str, ...] = ()
    budget_bytes: int | None = None

    KEYS = ("keep", "milestones", "pins", "budget")

    @classmethod
    def parse(cls, data: dict | None, source: str = "retention") -> "RetentionSettings | None":
        """None: no retention key, every push is kept."""
        data = optional_section(data, cls.KEYS, source, "like {keep: 3, budget: 800GB}")
        if data is None:
            return None
        keep = check_number(data.get("keep"), f"{source}.keep", *KEEP_RANGE,
                            why=" (the newest pushes whose checkpoints the hub keeps)")
        milestones = check_bool(data.get("milestones", True), f"{source}.milestones")
        pins = data.get("pins") or []
        if not isinstance(pins, list) or not all(isinstance(p, str) and _PIN.match(p.lower())
                                                 for p in pins):
            raise UserError(f"{source}.pins must be a list of revision ids (7 to 64 hex "
                            f"characters, as `fractus-pod sync history` shows), got {pins!r}")
        budget = data.get("budget")
        return cls(keep, milestones, tuple(p.lower() for p in pins),
                   None if budget is None else parse_size(budget, f"{source}.budget"))

    def below_one_push(self, one_push: int, measured: str) -> str | None:
        """The refusal of a budget below one push of `one_push` bytes; None when it fits."""
        if self.budget_bytes is None or one_push <= self.budget_bytes:
            return None
        return (f"retention.budget {human_bytes(self.budget_bytes)} is smaller than one push "
                f"({human_bytes(one_push)}, {measured}): raise retention.budget to at least "
                f"{human_bytes(one_push * (self.keep + 1))} (keep {self.keep} + the push in "
                f"flight)")


def parse_size(value, what: str) -> int:
    """Bytes from an integer or a string like "800GB", "1TiB", "500 MB"."""
    size = None
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (m := _SIZE.match(value)):
        size = int(float(m.group(1)) * _UNIT[m.group(2).upper()])
    low, high = BUDGET_RANGE
    if size is None or not low <= size <= high:
        raise UserError(f"{what} must be a size from 64KiB to 1EiB (bytes, or like \"800GB\", "
                        f"\"1TiB\"), got {value!r}")
    return size


def human_bytes(size: float) -> str:
    """Decimal units, as the Hub states its storage limits (100 GB, 1 TB)."""
    unit = "B"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(size) < 1000 or unit == "TB":
            break
        size /= 1000
    return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
