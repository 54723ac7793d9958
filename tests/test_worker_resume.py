"""Exact resume: N steps straight == k steps, stop, resume for N-k steps (bitwise, on CPU).

Real subprocesses and real signals; SS on (SS_RATE=0.5 with a fixed SEED, so some steps run
an SS pass and some do not)."""

import signal
import time

import pytest
import torch

from launcher.files import sha256_file
from tests.support.worker_utils import (events, load_ckpt, metrics_lines, read_jsonl,
                                        run_worker, start_worker, wait_for_line, worker_env,
                                        write_synth_shard)

COMMON = {"SS_RATE": "0.5", "LR": "0.05"}


def assert_same_training_state(a: dict, b: dict):
    assert set(a["model_state"]) == set(b["model_state"])
    for name, value in a["model_state"].items():
        assert torch.equal(value, b["model_state"][name]), name
    sa, sb = a["optimizer_state"]["state"], b["optimizer_state"]["state"]
    assert set(sa) == set(sb) and len(sa) > 0
    for idx in sa:
        assert torch.equal(sa[idx]["momentum_buffer"], sb[idx]["momentum_buffer"]), idx
    ta, tb = a["train_state"], b["train_state"]
    for key in ("next_token", "step", "ema_tf", "ema_ss", "carry_batch"):
        assert ta[key] == tb[key], key
    assert ta["rng"]["python"] == tb["rng"]["python"]
    assert torch.equal(ta["rng"]["torch"], tb["rng"]["torch"])


def test_accum_2_stop_and_resume_is_bitwise_identical(tmp_path):
    """ACCUM=2 split by MAX_STEPS (the SIGTERM test below covers ACCUM 1 and 2)."""
    accum = 2
    shard = write_synth_shard(tmp_path / "shard.npy", tokens=3000)
    straight = worker_env(tmp_path / "a", SHARD=shard, MAX_STEPS=5, ACCUM=accum, **COMMON)
    assert run_worker(straight).returncode == 0

    split = worker_env(tmp_path / "b", SHARD=shard, MAX_STEPS=2, ACCUM=accum, **COMMON)
    assert run_worker(split).returncode == 0
    first = load_ckpt(split["CKPT_OUT"])["train_state"]
    assert first["step"] == 2 and first["next_token"] == 2 * accum * 2 * 16
    split["MAX_STEPS"] = "3"  # resumes from the existing CKPT_OUT, no START_TOKEN needed
    proc = run_worker(split)
    assert proc.returncode == 0, proc.stderr

    a, b = load_ckpt(straight["CKPT_OUT"]), load_ckpt(split["CKPT_OUT"])
    assert a["train_state"]["ema_ss"] is not None  # SS passes ran
    assert_same_training_state(a, b)
    start = events(read_jsonl(split["METRICS"]), "start")
    assert [s["resume"] for s in start] == ["fresh", "full"]
    assert start[1]["next_token"] == first["next_token"]


@pytest.mark.parametrize("accum", [1, 2])
def test_sigterm_finishes_the_step_checkpoints_and_resumes_exactly(tmp_path, accum):
    """A checkpoint every step, written in the background (ASYNC_SAVE=1, the default),
    SIGTERM mid-run, resume: the end state equals a straight run's whose only checkpoint was
    written on the training thread (ASYNC_SAVE=0)."""
    steps, per_step = 24, 32 * accum
    shard = write_synth_shard(tmp_path / "shard.npy", tokens=steps * per_step + 1)  # exactly
    straight = worker_env(tmp_path / "a", SHARD=shard, ACCUM=accum, ASYNC_SAVE=0, **COMMON)
    proc = run_worker(straight)
    assert proc.returncode == 0, proc.stderr
    done = events(read_jsonl(straight["METRICS"]), "done")
    assert done[-1]["reason"] == "end_of_shard" and done[-1]["step"] == steps

    env = worker_env(tmp_path / "b", SHARD=shard, ACCUM=accum, SAVE_EVERY=1, **COMMON)
    child = start_worker(env)
    deadline = time.time() + 90
    while not [m for m in metrics_lines(read_jsonl(env["METRICS"])) if m["step"] >= 3] \
            and time.time() < deadline:
        time.sleep(0.02)
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=90) == 0, child.stderr.read()
    records = read_jsonl(env["METRICS"])
    stopped = events(records, "done")[-1]
    k = stopped["step"]
    assert stopped["reason"] == "signal" and 3 <= k < steps
    saves = events(records, "checkpoint")
    assert [c["step"] for c in saves] == list(range(1, k + 1))   # one per step, in order
    assert saves[-1]["next_token"] == k * per_step
    assert saves[-1]["sha256"] == sha256_file(env["CKPT_OUT"])
    assert all(c["stall_s"] <= c["seconds"] for c in saves)
    assert records.index(saves[-1]) < records.index(stopped)     # durable before `done`

    proc = run_worker({**env, "SAVE_EVERY": "0"})   # resume from CKPT_OUT to the end
    assert proc.returncode == 0, proc.stderr
    assert events(read_jsonl(env["METRICS"]), "start")[-1]["next_token"] == k * per_step
    assert_same_training_state(load_ckpt(straight["CKPT_OUT"]), load_ckpt(env["CKPT_OUT"]))


def test_second_signal_exits_at_once(tmp_path):
    shard = write_synth_shard(tmp_path / "shard.npy", tokens=2000)
    env = worker_env(tmp_path, SHARD=shard, FRACTUS_FAULT="hang@2")
    child = start_worker(env)
    deadline = time.time() + 60
    while not metrics_lines(read_jsonl(env["METRICS"])) and time.time() < deadline:
        time.sleep(0.02)
    child.send_signal(signal.SIGTERM)
    wait_for_line(child, "SIGTERM: finishing the step")     # taken: it only asks
    child.send_signal(signal.SIGINT)
    # 130, not 0: the worker was still in its hanging step when SIGINT came, and SIGINT
    # found the stop already asked (a SIGINT taken first would have only asked, too).
    assert child.wait(timeout=10) == 128 + signal.SIGINT
    records = read_jsonl(env["METRICS"])
    assert not events(records, "checkpoint") and not events(records, "done")


def test_batch_change_resets_the_carried_state(tmp_path):
    """Also: a legacy int64 .pt shard, and an explicit START_TOKEN that agrees."""
    torch.save(torch.randint(0, 512, (400,), dtype=torch.int64), tmp_path / "shard.pt")
    env = worker_env(tmp_path, SHARD=tmp_path / "shard.pt", MAX_STEPS=2)
    assert run_worker(env).returncode == 0
    env.update(BATCH="3", START_TOKEN="64")
    proc = run_worker(env)
    assert proc.returncode == 0, proc.stderr
    change = events(read_jsonl(env["METRICS"]), "batch_change")
    assert len(change) == 1 and (change[0]["old"], change[0]["new"]) == (2, 3)
    ts = load_ckpt(env["CKPT_OUT"])["train_state"]
    assert ts["carry_batch"] == 3 and ts["step"] == 4 and ts["next_token"] == 2 * 32 + 2 * 48


def test_start_token_rules(tmp_path, capsys):
    from fractus.train.worker import main
    shard = write_synth_shard(tmp_path / "shard.npy", tokens=3000)
    env = worker_env(tmp_path, SHARD=shard, MAX_STEPS=1)
    assert run_worker(env).returncode == 0  # full checkpoint at next_token 32

    assert main({**env, "START_TOKEN": "100"}) == 2  # setup only: safe in-process
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "FORCE_START_TOKEN" in err and "next_token=32" in err
    forced = run_worker({**env, "START_TOKEN": "101", "FORCE_START_TOKEN": "1"})
    assert forced.returncode == 0, forced.stderr
    assert events(read_jsonl(env["METRICS"]), "start")[-1]["next_token"] == 101
    assert load_ckpt(env["CKPT_OUT"])["train_state"]["next_token"] == 101 + 32

    legacy = tmp_path / "legacy.pt"
    full = load_ckpt(env["CKPT_OUT"])
    torch.save({"model_state": full["model_state"], "config": full["config"]}, legacy)
    other = worker_env(tmp_path / "c", SHARD=shard, MAX_STEPS=1, CKPT_IN=legacy)
    assert main(other) == 2
    assert "START_TOKEN is required" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()  # nothing written
