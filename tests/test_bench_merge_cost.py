"""benchmarks/bench_merge_cost.py --smoke (the tiny preset, 2 sources, in one process): it runs
the round's phases through the project's own code and reports every field the stall and
BENCHMARKS.md's table are made of, and --report prints a saved run again; the numbers are
not checked (they belong to the 1B run)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_smoke_run_reports_every_phase_and_the_stall(tmp_path):
    out = tmp_path / "cost.json"
    done = subprocess.run([sys.executable, "benchmarks/bench_merge_cost.py", "--smoke",
                           "--dir", str(tmp_path), "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["preset"] == "tiny" and r["sources_skipped"] == []
    assert {"save_s", "save_bytes", "sha256_gbps", "save_peak_rss_gb"} <= set(r["save"])
    assert r["round1"]["round"] == 1 and r["round1"]["step"] == "mean"
    assert [m["n"] for m in r["merge"]] == [2]
    assert all({"seconds", "cpu_s", "peak_rss_gb", "peak_anon_gb", "file_bytes_read",
                "bytes_written"} <= set(m) and m["step"] == "nesterov" for m in r["merge"])
    # the worker's own check passed and the weights moved into the model
    assert r["adoption"]["adopted"] is True and r["adoption"]["tensors"] > 0
    assert {"cpu_s", "gpu_s", "flops", "build_s", "chunk_s"} <= set(r["gate"])
    assert set(r["gate"]["by_layers"]) == {"1", "2"}
    pushed = r["pushed"]
    assert pushed["total"] == pushed["round_file"] + pushed["outer_state"] \
        + pushed["ledger_one_round"]
    for where in ("here", "pod", "pod_gpu_gate"):
        assert set(r["stall"][where]) == {"save", "merge", "gate", "adoption", "total",
                                          "fraction", "every_h_for_2pct"}
    # the printed table names every phase; the work folder is gone
    for phase in ("save of one GPU", "`outer_step` round 2", "adoption", "gate, CPU",
                  "gate on the GPU", "bytes pushed", "pod, projected"):
        assert phase in done.stdout
    assert not list(tmp_path.glob("bench_merge_cost_*"))
    # --report prints the saved run's table again, the projection under new assumptions
    again = subprocess.run([sys.executable, "benchmarks/bench_merge_cost.py", "--report",
                            str(out), "--round-every-s", "7200"],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "of 7200 s" in again.stdout and "`outer_step` round 2" in again.stdout
