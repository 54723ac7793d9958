"""The goodput ledger of the recorded pod (tests/fixtures/recorded_pod: a real run of three
launches, two canaries and a NaN rollback): every GPU adds up, the rollback is booked. The
ledger of a live run with a hang and a kill -9: tests/test_launcher_hang.py."""

import shutil
from pathlib import Path

import pytest

from launcher.dashboard.goodput_files import pod_ledger
from launcher.pod.events import read_events

RECORDED = Path(__file__).resolve().parent / "fixtures" / "recorded_pod"


def test_the_recorded_pods_rollback_is_booked_and_every_gpu_adds_up(tmp_path):
    pod = tmp_path / "pod"
    shutil.copytree(RECORDED, pod)
    ledger = pod_ledger(pod, price_per_gpu_hour=2.0)
    assert ledger.sessions == 3 and set(ledger.gpus) == {0, 1}
    for led in ledger.gpus.values():
        assert led.trained_s + led.lost_total_s == pytest.approx(led.wall_s)
        assert led.lost_s["canary"] > 0      # the canaries before the stage 2 launches
    (rollback,) = [e for e in read_events(pod) if e["event"] == "rollback"]
    rolled, other = ledger.gpus[rollback["gpu"]], ledger.gpus[1 - rollback["gpu"]]
    assert rolled.lost_s["retrain_rollback"] > 0 and rolled.tokens_retrained > 0
    assert other.lost_s["retrain_rollback"] == 0 and other.tokens_retrained == 0
    assert ledger.to_dict()["cost"] == pytest.approx(ledger.gpu_seconds / 3600 * 2.0, abs=0.01)


def test_the_fast_reader_reads_a_real_workers_lines_as_json_does():
    from launcher.dashboard.goodput import marks_of
    from launcher.dashboard.goodput_files import read_marks
    from launcher.worker.process import read_records
    for gpu in (0, 1):
        path = RECORDED / "logs" / f"metrics_gpu{gpu}.jsonl"
        fast = read_marks(path)
        assert len(fast) > 100 and sorted(fast) == sorted(marks_of(read_records(path)))


def test_a_kept_reader_reads_only_what_was_appended_and_starts_over_on_a_new_file(tmp_path):
    from launcher.dashboard.goodput_files import MarksTail
    path = tmp_path / "metrics_gpu0.jsonl"
    lines = (RECORDED / "logs" / "metrics_gpu0.jsonl").read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:10]) + lines[10][:20])      # a line half written
    tail = MarksTail(path)
    first = list(tail.read())
    with open(path, "ab") as f:
        f.write(lines[10][20:] + b"".join(lines[11:30]))
    assert tail.read()[:len(first)] == first
    assert tail.read() == MarksTail(path).read() and len(tail.read()) > len(first)
    replaced = tmp_path / "new.jsonl"
    replaced.write_bytes(b"".join(lines[:3]))
    replaced.replace(path)                                         # another file, same name
    assert tail.read() == MarksTail(path).read()
