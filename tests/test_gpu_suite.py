"""benchmarks/gpu_suite.sh --dry-run: the device check's every part, its arguments and its
outputs, proven on the CPU before any GPU is lent (the same script runs on the GPU).

One real run (tiny preset, CPU, COMPILE=0 but stage 4's ladder run, compiled by inductor):
every part reports in the summary table printed last, after a row per stage; each result
file holds what the part measured, and no more than the 8 files a device call brings back
are written.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SUITE = REPO / "benchmarks" / "gpu_suite.sh"
PARTS = ("equivalence", "ladder", "async_save", "canary_band", "ar_probe")
FILES = {"env.txt", "suite.log", "summary.md", "equivalence.txt", "ladder.json",
         "async_save.json", "canary_band.json", "probe.json"}


def run_suite(out: Path, *args: str, timeout: float = 3000) -> subprocess.CompletedProcess:
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    return subprocess.run(["bash", str(SUITE), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_dry_run_runs_every_part_and_writes_its_results(tmp_path):
    out = tmp_path / "out"
    done = run_suite(out, "--dry-run")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    # The summary table is the last thing on stdout, one row per part, each passed.
    lines = done.stdout.strip().splitlines()
    header = max(i for i, line in enumerate(lines) if line.startswith("| part | status |"))
    rows = {cells[0]: cells for cells in
            ([c.strip() for c in line.strip("|").split("|")] for line in lines[header + 2:])}
    assert list(rows) == list(PARTS) and len(lines) == header + 2 + len(PARTS)
    assert all(rows[name][1] == "ok" for name in PARTS), rows
    assert (out / "summary.md").read_text().strip().endswith(lines[-1])
    stage_header = lines.index("| stage | settings | tok/s | peak GB | compile s | graph breaks "
                               "| recompiles | MFU | band |")
    stage_rows = [[c.strip() for c in line.strip("|").split("|")]
                  for line in lines[stage_header + 2:stage_header + 7]]
    assert [r[0] for r in stage_rows] == ["1", "2", "3", "4", "5"]
    assert stage_rows[3][4:7] != ["-", "-", "-"] and stage_rows[3][8] == "compiled vs eager: ok"
    assert "triton" in (out / "env.txt").read_text()
    assert {p.name for p in out.iterdir()} == FILES          # at most 8 files come back

    assert "skipped" in (out / "equivalence.txt").read_text()     # CUDA cases: collected
    ladder = json.loads((out / "ladder.json").read_text())
    assert sorted(ladder["stages"]) == ["1", "2", "3", "4", "5"] and ladder["cut"] is None
    for number, stage in ladder["stages"].items():
        assert stage["outcome"] == "ok" and stage["tok_s"] > 0 and stage["mem_gb"] > 0, number
        assert stage["first_step_s"] > 0 and stage["mfu"] > 0
    assert ladder["stages"]["4"]["settings"]["BATCH"] == "8"     # each stage's own settings
    assert ladder["stages"]["5"]["settings"]["ACCUM"] == "2"
    compiled = ladder["stages"]["4"]        # the dry run's one compiled run: it compiles once
    assert compiled["settings"]["COMPILE"] == "1" and compiled["compile_status"] == "ok"
    assert compiled["graph_breaks"] == 0 and compiled["recompiles"] == 0
    # Stage 1 is the reference loop bit for bit on the CPU (a band on CUDA).
    assert ladder["reference"]["equal"] and ladder["reference"]["max_rel_diff"] == 0
    assert ladder["fit"]["batch"] == 8 and ladder["fit"]["tries"][0]["fits"]
    assert ladder["fit"]["model_batch"] == 8          # the memory model's, capped at --fit-max
    assert {r["outcome"] for r in ladder["fit"]["confirm"].values()} == {"ok"}
    saved = json.loads((out / "async_save.json").read_text())
    assert saved["device"] == "cpu" and saved["sync_stall_s"] > 0 and saved["async_stall_s"] > 0
    band = json.loads((out / "canary_band.json").read_text())
    assert [r["switch"] for r in band["results"]] == ["1->2", "1->1 (noise)"]
    probe = json.loads((out / "probe.json").read_text().strip().splitlines()[-1])
    assert math.isfinite(probe["ar"]) and probe["next_token"] == 4 * 4 * 32   # stage 1's head


def test_a_bad_argument_exits_2_with_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    done = run_suite(out, "--dryrun", timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "error: unknown argument '--dryrun' (expected --dry-run or nothing)"]
    assert not out.exists()
