"""The compiled training step compiles once: one graph, no graph break, no recompile.

Traced with `backend="eager"`: dynamo's graph capture and guards exactly as with inductor
(graph breaks and recompiles are decided there), without inductor's code generation, so
each case takes seconds on a loaded CPU. Before the fix, chunked CE broke the graph three
times (the target range check read the ids with `.item()`, and its value specialised the
graph: a recompile per new min/max), the carried `thought_state` (a strided view of h) and
the carried phases ((B, 1, N) after a reset, (B, C, N) after a chunk) recompiled the step at
step 2, and the TF pass's `return_hidden` variant recompiled it at the first SS pass.
"""

from __future__ import annotations

import json
import random
import signal

import pytest
import torch
from torch._dynamo.utils import counters

from fractus.config import PRESETS
from fractus.continuous_engine import ContinuousThoughtEngine
from fractus.nn import attention
from fractus.train import step as step_module
from fractus.train.env import WorkerSettings
from fractus.train.step import TrainStep
from fractus.train.worker import Worker
from tests.support.worker_utils import read_jsonl, worker_env, write_synth_shard

ONCE = {"graphs": 1, "graph_breaks": 0, "recompiles": 0}


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()
    attention.set_attention_impl(None)


def _trainer(batch: int, seq: int, **env) -> TrainStep:
    torch.manual_seed(0)
    random.seed(0)
    model = ContinuousThoughtEngine.from_config(PRESETS["tiny"])
    model.reset_thought(batch)
    model.set_gate_temperature(2.5)
    settings = WorkerSettings.from_env({"BATCH": str(batch), "SEQ": str(seq), **env})
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    return TrainStep(model, optimizer, settings, torch.device("cpu"))


@pytest.mark.parametrize("impl, env", [
    ("cumsum", {"CE_CHUNK": "0", "SS_RATE": "1"}),                 # stage 1: dense CE, SS
    ("chunked", {"CE_CHUNK": "24", "SS_RATE": "0.5"}),             # stages 2-4: chunked CE
    ("chunked", {"CE_CHUNK": "24", "SS_RATE": "0.5", "ACCUM": "2"}),  # stage 5
], ids=["dense_ss", "chunked_ss", "chunked_accum2"])
def test_the_compiled_step_is_one_graph_that_never_recompiles(fresh_dynamo, impl, env):
    attention.set_attention_impl(impl)
    batch, seq = 2, 16
    trainer = _trainer(batch, seq, **env)
    trainer.compile(backend="eager")
    accum = int(env.get("ACCUM", "1"))
    generator = torch.Generator().manual_seed(1)
    ss_passes = 0
    for step in range(1, 5):
        batches = [(torch.randint(0, 512, (batch, seq), generator=generator),
                    torch.randint(0, 512, (batch, seq), generator=generator))
                   for _ in range(accum)]
        result = trainer(batches, step)
        ss_passes += result.ss is not None
        assert trainer.compile_counts() == ONCE, f"step {step}"
    assert ss_passes, "no SS pass ran: the sampling variant went unchecked"


def test_a_new_batch_size_compiles_the_step_exactly_once(fresh_dynamo):
    """A stage switch's new BATCH (a new worker) compiles once for its shape."""
    attention.set_attention_impl("chunked")
    trainer = _trainer(3, 16, CE_CHUNK="24", SS_RATE="0")
    trainer.compile(backend="eager")
    for step in (1, 2):
        trainer([(torch.randint(0, 512, (3, 16)), torch.randint(0, 512, (3, 16)))], step)
    assert trainer.compile_counts() == ONCE


def test_the_worker_records_its_compile_counts_and_a_recompile(tmp_path, fresh_dynamo,
                                                              monkeypatch):
    """The `compile` event carries torch's counts; a later recompile is its own event."""
    eager_compile = TrainStep.compile
    monkeypatch.setattr(step_module.TrainStep, "compile",
                        lambda self: eager_compile(self, backend="eager"))
    shard = write_synth_shard(tmp_path / "shard.npy", tokens=2000)
    env = worker_env(tmp_path, SHARD=shard, MAX_STEPS=3, COMPILE="1", CE_CHUNK="24",
                     SS_RATE="0", FRACTUS_ATTN_IMPL="chunked")
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        worker = Worker(WorkerSettings.from_env(env))
        worker.setup()
        before_step = worker.faults.before_step

        def change_a_guarded_value(step):      # a python float the graph specialised on
            if step == 2:
                worker.model.set_gate_temperature(3.0)
            before_step(step)
        worker.faults.before_step = change_a_guarded_value
        assert worker.run() == 0
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    compiles = [r for r in read_jsonl(env["METRICS"]) if r.get("event") == "compile"]
    assert [c["status"] for c in compiles] == ["ok", "recompiled"]
    assert {k: compiles[0][k] for k in ONCE} == ONCE and compiles[0]["seconds"] > 0
    assert compiles[1]["recompiles"] == 1 and compiles[1]["step"] == 2


def test_status_shows_a_gpu_whose_step_recompiled(tmp_path):
    from launcher.dashboard import status
    from launcher.dashboard.status_table import COLUMNS
    from launcher.paths import metrics_path
    path = tmp_path / metrics_path(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    records = [{"type": "event", "event": "compile", "ts": 10.0, "status": "ok", **ONCE},
               {"type": "event", "event": "compile", "ts": 20.0, "status": "recompiled",
                "graphs": 2, "graph_breaks": 0, "recompiles": 1, "step": 7}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert status._compile_note(tmp_path, 0, {"started_at": 5.0})["recompiles"] == 1
    none = {"recompiles": None, "compile_fallback": None}
    assert status._compile_note(tmp_path, 0, {"started_at": 30.0}) == none  # an older run's
    assert status._compile_note(tmp_path, 0, None) == none                   # not running
    state = next(c for c in COLUMNS if c.header == "state")
    assert state.cell({"state": "running", "recompiles": 1}) == "running (recompiled 1x)"
    assert state.cell({"state": "running", "recompiles": 0}) == "running"


@pytest.mark.parametrize("fallback", ["diverged", "failed"])
def test_status_shows_a_gpu_that_went_on_uncompiled(tmp_path, fallback):
    from launcher.dashboard import status
    from launcher.dashboard.status_table import COLUMNS
    from launcher.paths import metrics_path
    path = tmp_path / metrics_path(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"type": "event", "event": "compile", "ts": 10.0,
                                "status": fallback, "reason": "tf 0.5 vs 0.25", **ONCE}) + "\n")
    note = status._compile_note(tmp_path, 0, {"started_at": 5.0})
    assert note == {"recompiles": None, "compile_fallback": fallback}
    state = next(c for c in COLUMNS if c.header == "state")
    assert state.cell({"state": "running", **note}) == f"running (uncompiled: compile {fallback})"


def test_the_gpu_suite_reports_the_first_compile_and_the_latest_counts():
    from benchmarks.gpu_worker_run import compile_fields
    records = [{"type": "event", "event": "start"},
               {"type": "event", "event": "compile", "status": "ok", "seconds": 95.0, **ONCE},
               {"type": "metrics", "step": 1},
               {"type": "event", "event": "compile", "status": "recompiled", "step": 2,
                "graphs": 2, "graph_breaks": 0, "recompiles": 1}]
    assert compile_fields(records) == {"compile_s": 95.0, "compile_status": "ok",
                                       "graph_breaks": 0, "recompiles": 1}
    assert compile_fields(records[:1]) == {}
