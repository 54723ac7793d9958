"""The summary tables of benchmarks/gpu_suite.sh: one row per stage of the ladder (settings,
tok/s, peak GB, compile s, graph breaks, recompiles, MFU, band), then one row per part, read
from its result files, plus the part's exit status and seconds (`--part NAME=RC:SECONDS`,
from the script); the parts' table comes last.
Written to OUT/summary.md and printed (the suite's last lines on stdout). Exit status 1
when a part did not run or did not pass.

    python -m benchmarks.gpu_summary --out gpu-results --part equivalence=0:41.2 ...
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import common  # noqa: E402

# part name -> (its results file under OUT, the function that says what it found)
PARTS = {}


def part(name: str, filename: str):
    def register(fn):
        PARTS[name] = (filename, fn)
        return fn
    return register


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _g(value, spec=".3g") -> str:
    return "-" if value is None else format(value, spec)


@part("equivalence", "equivalence.txt")
def _equivalence(path: Path) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    counts = re.findall(r"(\d+) (passed|failed|skipped|deselected|error)", text)
    return ", ".join(f"{n} {what}" for n, what in counts) or "no pytest summary"


@part("ladder", "ladder.json")
def _ladder(path: Path) -> str:
    data = _json(path)
    if not data:
        return "no results"
    cells = []
    for number, row in sorted(data.get("stages", {}).items()):
        cells.append(f"s{number} {row.get('outcome')} {_g(row.get('tok_s'), '.0f')} tok/s "
                     f"mem {_g(row.get('mem_gb'))} GB MFU {_g(row.get('mfu'), '.2%')}"
                     + (f" compile {_g(row.get('compile_s'), '.0f')}s"
                        if row.get("compile_s") else "")
                     + f" first step {_g(row.get('first_step_s'), '.0f')}s")
    ref = data.get("reference") or {}
    if ref:
        cells.append(f"stage 1 vs reference: max rel ema_tf diff {_g(ref.get('max_rel_diff'))}"
                     + (f" ({ref['error']})" if ref.get("error") else ""))
    fit = data.get("fit") or {}
    if fit:
        cells.append(f"fit BATCH {fit.get('batch')} (limit {_g(fit.get('limit_gb'))} GB, "
                     f"{len(fit.get('tries', []))} tries{'; ' + fit['cut'] if fit.get('cut') else ''})")
    if data.get("cut"):
        cells.append(f"cut: {data['cut']}")
    return "; ".join(cells)


@part("async_save", "async_save.json")
def _async_save(path: Path) -> str:
    data = _json(path)
    if not data:
        return "no results"
    if "error" in data:
        return f"error: {data['error']}"
    return (f"stall sync {_g(data.get('sync_stall_s'))} s, async {_g(data.get('async_stall_s'))} s "
            f"(ratio {_g(data.get('stall_ratio'))}, first prepared "
            f"{_g(data.get('stall_ratio_prepared'))}); {_g(data.get('bytes', 0) / 1e9)} GB file")


@part("canary_band", "canary_band.json")
def _canary(path: Path) -> str:
    data = _json(path)
    if not data:
        return "no results"
    return "; ".join(f"{r['switch']} {'passed' if r['passed'] else 'not passed'} max rel tf "
                     f"{_g(r.get('max_rel_tf'))}" for r in data.get("results", []))


@part("ar_probe", "probe.json")
def _probe(path: Path) -> str:
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    data = next((json.loads(s) for s in reversed(lines) if s.startswith("{")), None)
    if not data:
        return "no results"
    return f"AR {_g(data.get('ar'))}, ARacc {_g(data.get('ar_acc'))}, cold CE {_g(data.get('cold_tf'))}"


STAGE_HEADERS = ["stage", "settings", "tok/s", "peak GB", "compile s", "graph breaks",
                 "recompiles", "MFU", "band"]


def _band(number: str, row: dict, reference: dict) -> str:
    """Stage 1: its ema_tf against the reference loop's. A compiled stage: its first
    compiled step against the eager step (the worker's check, fractus/train/step.py
    COMPILE_BAND): `ok` within, `diverged` or `failed` (then it ran eager)."""
    if number == "1" and reference.get("max_rel_diff") is not None:
        return f"vs reference {_g(reference['max_rel_diff'])}"
    if row.get("compile_status"):
        return f"compiled vs eager: {row['compile_status']}"
    return "-"


def stage_rows(out: Path) -> list[list[str]]:
    """One row per stage of the ladder (ladder.json), [] without one."""
    data = _json(out / "ladder.json") or {}
    reference = data.get("reference") or {}
    rows = []
    for number, row in sorted(data.get("stages", {}).items()):
        settings = row.get("settings", {})
        label = " ".join(f"{k}={settings[k]}" for k in ("BATCH", "CE_CHUNK", "FRACTUS_ATTN_IMPL",
                                                         "COMPILE", "ACCUM") if k in settings)
        rows.append([number, label, _g(row.get("tok_s"), ".0f"), _g(row.get("mem_gb")),
                     _g(row.get("compile_s"), ".0f"), _g(row.get("graph_breaks"), "d"),
                     _g(row.get("recompiles"), "d"), _g(row.get("mfu"), ".2%"),
                     _band(number, row, reference)])
    return rows


def status(code: int | None) -> str:
    if code is None:
        return "not run"
    return {0: "ok", 124: "cut (timeout)", 137: "killed (timeout)"}.get(code, f"failed (rc {code})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--part", action="append", default=[], help="NAME=RC:SECONDS")
    ap.add_argument("--title", default="GPU suite")
    args = ap.parse_args(argv)
    ran = {}
    for item in args.part:
        name, _, rest = item.partition("=")
        code, _, seconds = rest.partition(":")
        ran[name] = (int(code), float(seconds))
    rows = []
    for name, (filename, found) in PARTS.items():
        code, seconds = ran.get(name, (None, None))
        try:
            what = found(args.out / filename)
        except Exception as exc:       # a summary never fails on a part's odd file
            what = f"unreadable {filename}: {exc}"
        rows.append([name, status(code), _g(seconds, ".0f"), filename, what])
    table = common.markdown_table(["part", "status", "s", "file", "found"], rows)
    stages = stage_rows(args.out)
    per_stage = (f"### Stages\n\n{common.markdown_table(STAGE_HEADERS, stages)}\n\n"
                 if stages else "")
    text = f"## {args.title}\n\n{per_stage}{table}\n"
    (args.out / "summary.md").write_text(text)
    print(text, end="")
    return 0 if all(ran.get(name, (1,))[0] == 0 for name in PARTS) else 1


if __name__ == "__main__":
    sys.exit(main())
