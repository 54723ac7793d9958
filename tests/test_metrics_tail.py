"""MetricsTail, the one reader of a worker's METRICS file (the supervisor's records, a Ray
node's forwarded lines): complete lines only, and a position another tail resumes from."""

import json

from launcher.worker.process import MetricsTail


def test_complete_lines_only_and_a_position_another_tail_resumes_from(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2}\n{"ste')
    tail = MetricsTail(path, from_end=False)
    assert tail.read_lines() == [b'{"step": 1}', b'{"step": 2}']
    assert tail.position == len(b'{"step": 1}\n{"step": 2}\n')    # not past the torn line
    with open(path, "ab") as f:
        f.write(b'p": 3}\nnot json\n')
    successor = MetricsTail(path, offset=tail.position)   # e.g. a replacement Ray actor
    assert [json.loads(line) for line in tail.read_lines()[:1]] == [{"step": 3}]
    assert successor.read() == [{"step": 3}]               # the unreadable line is skipped
    assert tail.position == successor.position == path.stat().st_size
