"""The first compiled step is judged against the eager step from the same point: outside
the band (or not finite where eager is) the worker says why and continues eager.

Compiled with `backend="eager"` (dynamo's trace without inductor: seconds on the CPU); the
`diverge` fault doubles the compiled step's cross-entropy, as a miscompiled step would
move it. Before, the first compiled step's result was taken as it came.
"""

from __future__ import annotations

import signal

import pytest
import torch
from torch._dynamo.utils import counters

from fractus.nn import attention
from fractus.train import step as step_module
from fractus.train.env import WorkerSettings
from fractus.train.step import NonFiniteError, StepResult, TrainStep, compiled_divergence
from fractus.train.worker import Worker
from tests.support.worker_utils import events, load_ckpt, read_jsonl, worker_env, write_synth_shard


@pytest.fixture
def eager_backend(monkeypatch):
    torch._dynamo.reset()
    counters.clear()
    compile_ = TrainStep.compile
    monkeypatch.setattr(step_module.TrainStep, "compile",
                        lambda self: compile_(self, backend="eager"))
    yield
    torch._dynamo.reset()
    counters.clear()
    attention.set_attention_impl(None)


def _run(tmp_path, shard, **env):
    """The worker in this process; its metrics records, its checkpoint and its trainer."""
    env = worker_env(tmp_path, SHARD=shard, MAX_STEPS=2, CE_CHUNK="24", SS_RATE="1",
                     ACCUM="2", FRACTUS_ATTN_IMPL="chunked", **env)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        worker = Worker(WorkerSettings.from_env(env))
        worker.setup()
        assert worker.run() == 0
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return read_jsonl(env["METRICS"]), load_ckpt(env["CKPT_OUT"]), worker.trainer


def test_a_compiled_step_outside_the_band_falls_back_to_the_eager_step(tmp_path,
                                                                      eager_backend):
    shard = write_synth_shard(tmp_path / "shard.npy", tokens=2000)
    _, eager_ckpt, _ = _run(tmp_path / "eager", shard)
    records, ckpt, trainer = _run(tmp_path / "diverged", shard, COMPILE="1",
                                  FRACTUS_FAULT="diverge@1")
    (event,) = events(records, "compile")
    assert event["status"] == "diverged" and event["reason"].startswith("tf ")
    assert event["graph_breaks"] == 0 and event["seconds"] > 0
    assert not trainer.compiled                       # the run continued eager
    # Step 1 is the eager step's (weights, optimizer, carried state and RNG rewound), and
    # step 2 ran eager: the same run as COMPILE=0.
    for name, value in eager_ckpt["model_state"].items():
        assert torch.equal(value, ckpt["model_state"][name]), name
    assert ckpt["train_state"]["ema_tf"] == eager_ckpt["train_state"]["ema_tf"]


def test_a_compiled_step_inside_the_band_stays_compiled(tmp_path, eager_backend):
    shard = write_synth_shard(tmp_path / "shard.npy", tokens=2000)
    records, _, trainer = _run(tmp_path / "ok", shard, COMPILE="1")
    assert [e["status"] for e in events(records, "compile")] == ["ok"]
    assert trainer.compiled


def test_not_finite_where_eager_is_finite_is_a_divergence():
    eager = StepResult(tf=6.2, lb=0.01, grad_norm=3.0, ss=None)
    nan = NonFiniteError(1, {"loss": float("nan"), "grad_norm": 1.0})
    assert compiled_divergence(nan, eager).startswith("not finite where the eager step is")
    assert compiled_divergence(eager, eager) is None
    assert compiled_divergence(StepResult(6.2, 0.01, 3.5, None), eager).startswith("grad_norm")
    assert compiled_divergence(StepResult(6.2, 1e-7, 3.0, None),
                               StepResult(6.2, 5e-7, 3.0, None)) is None    # lb's atol
