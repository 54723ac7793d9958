"""The environment contract: defaults, parsing, and one-line errors for bad values."""

import math

import pytest

from fractus.train.env import ENV_VARS, SettingsError, WorkerSettings
from fractus.train.faults import Fault, FaultInjector, parse_fault


def test_defaults_match_the_v1_trainer():
    s = WorkerSettings.from_env({})
    assert (s.batch, s.seq, s.lr, s.ss_rate, s.ss_prob, s.lb_coef, s.gate_temp) == \
        (4, 128, 7e-4, 0.25, 0.2, 0.02, 2.5)
    assert (s.ce_chunk, s.accum, s.compile, s.save_every, s.log_every, s.save_keep) == \
        (0, 1, False, 800, 40, 3)
    assert s.async_save is True   # new in v2: checkpoints written in the background
    assert s.start_token is None and s.max_steps == 0
    assert s.shard_path == "data/shard_gpu0.pt"     # v1 default (no such file here)
    assert s.ckpt_out_path == "checkpoints/fractus_1b_gpu0.pt"
    assert s.effective_seed == 42


def test_gpu_id_drives_derived_defaults():
    s = WorkerSettings.from_env({"GPU_ID": "5"})
    assert s.ckpt_out_path.endswith("fractus_1b_gpu5.pt") and s.effective_seed == 47
    assert WorkerSettings.from_env({"GPU_ID": "5", "SEED": "9"}).effective_seed == 9


def test_values_are_parsed():
    s = WorkerSettings.from_env({"BATCH": "8", "LR": "1e-3", "COMPILE": "1", "START_TOKEN": "123457",
                                 "FRACTUS_ATTN_IMPL": "chunked", "DEVICE": "cuda:1",
                                 "FRACTUS_FAULT": "nan@3", "SS_RATE": ""})
    assert s.batch == 8 and math.isclose(s.lr, 1e-3) and s.compile is True
    assert s.start_token == 123457 and s.attn_impl == "chunked" and s.device == "cuda:1"
    assert s.ss_rate == 0.25  # empty means unset


@pytest.mark.parametrize("name, raw, fragment", [
    ("BATCH", "x", "BATCH must be an integer >= 1, got 'x'"),
    ("BATCH", "0", "BATCH must be an integer >= 1, got '0'"),
    ("START_TOKEN", "-5", "START_TOKEN must be an integer >= 0"),
    ("START_TOKEN", "1.5e6", "START_TOKEN must be an integer"),
    ("LR", "0", "LR must be a number > 0"),
    ("LR", "nan", "LR must be a number > 0"),
    ("SS_RATE", "1.5", "SS_RATE must be a number >= 0 and <= 1"),
    ("COMPILE", "yes", "COMPILE must be 0 or 1"),
    ("ASYNC_SAVE", "on", "ASYNC_SAVE must be 0 or 1"),
    ("FRACTUS_ATTN_IMPL", "flash", "FRACTUS_ATTN_IMPL must be one of einsum, cumsum, chunked"),
    ("DEVICE", "tpu", "DEVICE must be cpu, cuda or cuda:N"),
    ("FRACTUS_FAULT", "boom@1", "FRACTUS_FAULT must be <kind>@<step>"),
    ("FRACTUS_FAULT", "nan@0", "FRACTUS_FAULT must be <kind>@<step>"),
])
def test_bad_values_name_the_variable(name, raw, fragment):
    with pytest.raises(SettingsError) as info:
        WorkerSettings.from_env({name: raw})
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_every_field_has_one_variable():
    assert len(ENV_VARS) == len(set(ENV_VARS))
    for name in ("GPU_ID", "START_TOKEN", "BATCH", "SEQ", "LR", "SS_RATE", "SS_PROB", "LB_COEF",
                 "GATE_TEMP", "CE_CHUNK", "FRACTUS_ATTN_IMPL", "COMPILE", "ACCUM", "SHARD",
                 "CKPT_IN", "CKPT_OUT", "MODEL", "DEVICE", "MAX_STEPS", "SAVE_EVERY", "LOG_EVERY",
                 "METRICS", "SEED", "SAVE_KEEP", "ASYNC_SAVE", "FORCE_START_TOKEN", "FRACTUS_FAULT"):
        assert name in ENV_VARS


def test_fault_parsing_and_firing():
    assert parse_fault(None) is None and parse_fault("") is None
    assert parse_fault("oom@12") == Fault("oom", 12)
    assert parse_fault("save_hang@4") == Fault("save_hang", 4)
    assert FaultInjector(Fault("save_hang", 4)).save_write_hook(3) is None
    inj = FaultInjector(parse_fault("crash@2"))
    inj.before_step(1)
    with pytest.raises(RuntimeError, match="injected crash"):
        inj.before_step(2)
    import torch
    with pytest.raises(torch.OutOfMemoryError):
        FaultInjector(Fault("oom", 1)).before_step(1)
    nan = FaultInjector(Fault("nan", 3))
    assert nan.loss_scale(2) is None and math.isnan(nan.loss_scale(3))


def test_the_worker_takes_its_attention_kernel_from_its_settings(tmp_path, monkeypatch):
    """FRACTUS_ATTN_IMPL reaches the engine through WorkerSettings (main's environ), not
    through the engine's own read of os.environ (kept for the user's scripts)."""
    from fractus.nn import attention
    from fractus.train.worker import main
    from tests.support.worker_utils import worker_env, write_synth_shard
    calls = []
    attention.register_attention_impl(
        "spy", lambda *a: calls.append(1) or attention.cumsum_attention(*a))
    monkeypatch.delenv("FRACTUS_ATTN_IMPL", raising=False)
    try:
        write_synth_shard(tmp_path / "shard.npy", tokens=500)
        assert main(worker_env(tmp_path, FRACTUS_ATTN_IMPL="spy", MAX_STEPS=1)) == 0
    finally:
        attention.set_attention_impl(None)
        attention.unregister_attention_impl("spy")
    assert calls
