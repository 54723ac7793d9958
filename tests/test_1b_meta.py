"""The 1B shapes without the device: the step traced on `meta` tensors, and its memory.

A meta tensor has a shape, a dtype and a device but no memory, and an op mixing it with a
tensor of another device fails: so the forward, backward, clipping, SGD step and the
scheduled-sampling pass of the `1b` preset run here in seconds, and a tensor the step
creates on the wrong device (a missing `device=`) or of the wrong dtype fails here, not on
the pod. benchmarks/memory_model.py's tracker counts every storage the step creates and
frees; its table for the 1B preset is in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import functools

import pytest
import torch

from benchmarks.memory_model import StorageTracker, step_memory
from fractus.config import PRESETS
from fractus.continuous_engine import ContinuousThoughtEngine
from fractus.train.checkpoint import training_payload
from fractus.train.env import WorkerSettings

SEQ = 16    # the widths are the 1B preset's; the sequence length changes no device or dtype
# The shipped stages' settings that change what the step allocates (ACCUM=2 runs the same
# passes twice: benchmarks/memory_model.py traces it, 20 s, too slow for the suite).
STAGES = {
    "stage1_dense_ce": {"CE_CHUNK": "0", "FRACTUS_ATTN_IMPL": "cumsum", "ACCUM": "1"},
    "stage3_chunked": {"CE_CHUNK": "2048", "FRACTUS_ATTN_IMPL": "chunked", "ACCUM": "1"},
}


def _n_params(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@functools.lru_cache(maxsize=None)
def _traced(settings: tuple):
    return step_memory("1b", 2, SEQ, dict(settings))


def _memory(settings: dict):
    """The 1B step at BATCH 2, traced once per settings in this module."""
    return _traced(tuple(sorted(settings.items())))


@pytest.mark.parametrize("name", list(STAGES))
def test_the_1b_step_runs_on_meta_tensors_and_its_memory_adds_up(name):
    memory = _memory(STAGES[name])
    with torch.device("meta"):
        n = _n_params(ContinuousThoughtEngine.from_config(PRESETS["1b"]))
    assert n > 1_000_000_000
    # float32 SGD momentum for every weight but the two unused heads (confidence and
    # salience, d+1 each: no gradient, so no momentum)
    assert memory.momentum == 4 * (n - 2 * (PRESETS["1b"].d_model + 1))
    assert memory.weights >= 4 * n                        # plus the carried state at B=2
    # the step adds at least a full set of float32 gradients on top
    assert memory.activations >= 4 * n


def test_the_1b_checkpoint_layout_on_meta_tensors():
    """The payload a 1B worker saves: legacy `model_state` + `config`, float32 weights of
    the preset's shapes, one momentum buffer per parameter of its shape."""
    with torch.device("meta"):
        model = ContinuousThoughtEngine.from_config(PRESETS["1b"])
    model.reset_thought(4)
    optimizer = torch.optim.SGD(model.parameters(), lr=7e-4, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    settings = WorkerSettings.from_env({"BATCH": "4"})
    payload = training_payload(model, optimizer, settings, next_token=0, step=1, ema_tf=None,
                               ema_ss=None, device=torch.device("cpu"), shard="s.npy")
    state = payload["model_state"]
    assert all(t.dtype == torch.float32 and t.device.type == "meta" for t in state.values())
    assert state["observe.weight"].shape == (PRESETS["1b"].vocab_size, PRESETS["1b"].d_model)
    assert state["blocks.15.attn_S"].shape[0] == 4 == payload["train_state"]["carry_batch"]
    momentum = payload["optimizer_state"]["state"]
    params = list(model.parameters())
    assert len(momentum) == len(params)
    for i, p in enumerate(params):
        assert momentum[i]["momentum_buffer"].shape == p.shape
    total = sum(t.untyped_storage().nbytes() for t in {t.untyped_storage()._cdata: t
                                                       for t in state.values()}.values())
    total += sum(s["momentum_buffer"].numel() * 4 for s in momentum.values())
    assert 8.7e9 < total < 8.9e9                          # docs/WORKER.md: 8.81 GB at B=4


def test_the_tracker_counts_each_storage_once_until_it_is_freed():
    tracker = StorageTracker()
    with tracker:
        a = torch.empty(1000, dtype=torch.float32, device="meta")
        view = a[10:]                                     # a view: no new storage
        b = torch.empty(500, dtype=torch.float32, device="meta")
        assert tracker.live == 6000 and tracker.peak == 6000
        del a, view
        c = torch.empty(250, dtype=torch.float32, device="meta")
    assert tracker.live == 3000 and tracker.peak == 6000
    del b, c
    assert tracker.live == 0
