"""The ladder's `fit` (benchmarks/gpu_ladder.py) starts from the memory model's largest
BATCH for the card, not from the stage's BATCH: its first try is the model's batch, and the
search goes down from it when the real peak is above the model, up when below.

The worker runs are stood in for (a peak of `ratio` times the modelled one), so the search
itself is what is checked, in seconds; the real runs are the GPU suite's dry run's
(tests/test_gpu_suite.py). Before, the first try was the stage's BATCH (8) and the search
only doubled up from it.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import pytest

from benchmarks import gpu_ladder
from benchmarks.memory_model import largest_batch, modelled_peak
from launcher.config.podconfig import DEFAULT_MANIFESTS
from launcher.config.stages import load_stages

CAPACITY = 50e6      # bytes: the tiny preset at SEQ 32 fits a few tens of rows


def _fit(tmp_path, monkeypatch, ratio: float) -> dict:
    stages = load_stages(DEFAULT_MANIFESTS / "stages.yaml")
    settings = stages[gpu_ladder.FIT_STAGES[0]].settings

    def measure(env, run_dir, timeout_s, stop_after_steps=None):
        peak = ratio * modelled_peak("tiny", int(env["BATCH"]), 32, settings)
        return SimpleNamespace(outcome="ok", steps=2, mem_gb=peak / 1e9, smi_peak_mib=None,
                               message=None, to_dict=lambda: {"outcome": "ok"})
    monkeypatch.setattr(gpu_ladder, "measure", measure)
    monkeypatch.setattr(gpu_ladder, "capacity_bytes", lambda device: CAPACITY)
    args = argparse.Namespace(preset="tiny", device="cpu", seq=32, headroom=0.1, fit_max=256,
                              threads=1, no_compile=True, run_timeout=60, steps=4)
    results = gpu_ladder.Results(None, {})
    gpu_ladder.fit_search(args, tmp_path, results, stages, time.monotonic() + 600)
    return results.data["fit"]


@pytest.mark.parametrize("ratio", [1.2, 0.8], ids=["above_the_model", "below_the_model"])
def test_the_fit_starts_from_the_memory_models_largest_batch(tmp_path, monkeypatch, ratio):
    settings = load_stages(DEFAULT_MANIFESTS / "stages.yaml")[gpu_ladder.FIT_STAGES[0]].settings
    model = largest_batch("tiny", 32, settings, CAPACITY, 0.1, limit=256)
    assert model not in (0, int(settings["BATCH"]))
    fit = _fit(tmp_path, monkeypatch, ratio)
    assert fit["model_batch"] == model and fit["tries"][0]["batch"] == model
    budget = CAPACITY * 0.9
    found = fit["batch"]
    assert ratio * modelled_peak("tiny", found, 32, settings) <= budget
    assert ratio * modelled_peak("tiny", found + 1, 32, settings) > budget
    assert len(fit["tries"]) <= 8 and set(fit["confirm"]) == {"4", "5"}
