"""Asynchronous checkpoint save, in process: the snapshot is the state at the step boundary,
bitwise; the event follows the durable file; one save in flight, one snapshot of memory.

Real torch.save, files, fsync and threads; the writer is held mid-write by the same hook
the worker's save_hang fault uses (save_checkpoint's on_write)."""

import threading

import pytest
import torch

from fractus.config import load_model_config
from fractus.continuous_engine import ContinuousThoughtEngine
from fractus.train.async_save import AsyncCheckpointer
from fractus.train.checkpoint import (NonFiniteCheckpointError, load_checkpoint,
                                      save_checkpoint, training_payload)
from fractus.train.env import WorkerSettings
from launcher.files import sha256_file

CPU = torch.device("cpu")


@pytest.fixture
def state():
    torch.manual_seed(0)
    model = ContinuousThoughtEngine.from_config(load_model_config("tiny"))   # tied output head
    model.reset_thought(2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        optimizer.state[p]["momentum_buffer"] = torch.randn_like(p)
    return model, optimizer


def payload(model, optimizer, step: int) -> dict:
    p = training_payload(model, optimizer, WorkerSettings.from_env({}), next_token=step * 32,
                         step=step, ema_tf=1.5, ema_ss=None, device=CPU, shard="s")
    p["train_state"]["saved_at"] = 0.0   # the one field that differs between two saves
    return p


class HeldWriter:
    """An on_write hook that holds the background writer once it has written bytes."""

    def __init__(self):
        self.writing, self.release = threading.Event(), threading.Event()

    def __call__(self, written: int) -> None:
        self.writing.set()
        assert self.release.wait(60), "writer never released"


def test_the_file_is_the_state_at_submit_byte_for_byte(tmp_path, state):
    """Training moves the weights, momentum and carried state while the write runs: the file
    is still byte for byte the synchronous save of the state at the step boundary."""
    model, optimizer = state
    expected = save_checkpoint(payload(model, optimizer, 1), tmp_path / "sync.pt")
    held = HeldWriter()
    durable = []
    saver = AsyncCheckpointer(tmp_path / "async.pt", 3, CPU,
                              on_durable=lambda saved, tag, timing: durable.append(saved),
                              on_write=lambda tag: held)
    saver.submit(payload(model, optimizer, 1), "step 1")
    assert held.writing.wait(30)
    with torch.no_grad():   # the next steps, in place, while the writer is mid-file
        for p in model.parameters():
            p.add_(1.0)
        for s in optimizer.state.values():
            s["momentum_buffer"].mul_(-2.0)
        model.load_carry_state({k: v + 3 for k, v in model.carry_state().items()})
    held.release.set()
    saver.wait()
    assert (tmp_path / "async.pt").read_bytes() == (tmp_path / "sync.pt").read_bytes()
    assert durable[0].sha256 == expected.sha256 and durable[0].bytes == expected.bytes
    ck = load_checkpoint(tmp_path / "async.pt")   # tied weights stay one storage
    assert ck["model_state"]["observe.weight"].data_ptr() == \
        ck["model_state"]["output_head.weight"].data_ptr()


def test_the_event_comes_only_once_the_file_is_durable(tmp_path, state):
    model, optimizer = state
    path = tmp_path / "fractus_1b_gpu0.pt"
    seen = []

    def on_durable(saved, tag, timing):   # what a launcher reading the event would find
        temps = [p.name for p in tmp_path.iterdir() if ".tmp." in p.name]
        seen.append((tag, sha256_file(path) == saved.sha256, temps, timing.seconds))

    held = HeldWriter()
    saver = AsyncCheckpointer(path, 3, CPU, on_durable,
                              on_write=lambda tag: held if tag == 2 else None)
    saver.submit(payload(model, optimizer, 1), 1)
    saver.wait()
    before = sha256_file(path)
    saver.submit(payload(model, optimizer, 2), 2)
    assert held.writing.wait(30)
    assert [s[0] for s in seen] == [1]          # mid-write: no event for step 2
    assert sha256_file(path) == before          # and the canonical file is still step 1's
    held.release.set()
    saver.wait()
    assert [(tag, same, temps) for tag, same, temps, _ in seen] == [(1, True, []), (2, True, [])]
    assert load_checkpoint(path)["train_state"]["step"] == 2
    assert load_checkpoint(path.with_name(path.name + ".1"))["train_state"]["step"] == 1


def test_one_save_in_flight_and_one_snapshot_of_memory(tmp_path, state):
    model, optimizer = state
    held = HeldWriter()
    durable = []
    saver = AsyncCheckpointer(tmp_path / "c.pt", 2, CPU,
                              lambda saved, tag, timing: durable.append(tag),
                              on_write=lambda tag: held if tag == 1 else None)
    saver.submit(payload(model, optimizer, 1), 1)
    assert held.writing.wait(30)
    buffers = {k: b.data_ptr() for k, b in saver.snapshot._buffers.items()}
    distinct = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in list(model.state_dict().values())
                + [s["momentum_buffer"] for s in optimizer.state.values()]}
    assert saver.snapshot.nbytes >= sum(distinct.values())
    one_snapshot = saver.snapshot.nbytes

    # The write in flight is released only once the second submit waits for it, and each
    # snapshot records which writes were durable when it was taken: the second snapshot
    # after the first write (no copy over buffers a write is still reading).
    durable_at_snapshot, wait_for_flight, take = [], saver.wait, saver.snapshot.take

    def waits_then_released():
        held.release.set()
        wait_for_flight()

    def recorded_take(copied):
        durable_at_snapshot.append(list(durable))
        return take(copied)
    saver.wait, saver.snapshot.take = waits_then_released, recorded_take
    second = threading.Thread(target=saver.submit, args=(payload(model, optimizer, 2), 2))
    second.start()
    second.join(60)
    assert not second.is_alive()
    held.release.set()                          # (a submit that did not wait: let it end)
    saver.wait()
    assert durable_at_snapshot == [[1]]         # waited for the write in flight
    assert {k: b.data_ptr() for k, b in saver.snapshot._buffers.items()} == buffers  # reused
    assert saver.snapshot.nbytes == one_snapshot
    assert load_checkpoint(tmp_path / "c.pt")["train_state"]["step"] == 2


def test_a_failed_background_write_is_raised_on_the_training_thread(tmp_path, state):
    model, optimizer = state
    path = tmp_path / "c.pt"
    events = []
    saver = AsyncCheckpointer(path, 3, CPU, lambda saved, tag, timing: events.append(tag))
    saver.submit(payload(model, optimizer, 1), 1)
    saver.wait()
    good = sha256_file(path)
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    saver.submit(payload(model, optimizer, 2), 2)
    with pytest.raises(NonFiniteCheckpointError):
        saver.wait()
    assert events == [1] and sha256_file(path) == good
    saver.wait()   # reported once


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_snapshot_is_the_state_at_submit_while_the_gpu_trains_on(tmp_path):
    """Pinned buffers, copies queued on the training stream: kernels launched right after
    submit (no synchronisation) must not leak into the file."""
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = ContinuousThoughtEngine.from_config(load_model_config("tiny")).to(device)
    model.reset_thought(2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        optimizer.state[p]["momentum_buffer"] = torch.randn_like(p)
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    p = training_payload(model, optimizer, WorkerSettings.from_env({}), next_token=32, step=1,
                         ema_tf=1.5, ema_ss=None, device=device, shard="s")
    saver = AsyncCheckpointer(tmp_path / "c.pt", 3, device, lambda *a: None)
    saver.submit(p, 1)
    assert all(b.is_pinned() for b in saver.snapshot._buffers.values())
    with torch.no_grad():
        for _ in range(20):   # queued behind the copies on the same stream
            for param in model.parameters():
                param.mul_(1.5).add_(1.0)
    saver.wait()
    ck = load_checkpoint(tmp_path / "c.pt")
    for name, value in expected.items():
        assert torch.equal(ck["model_state"][name], value), name


def test_prepared_buffers_are_the_ones_the_first_save_fills(tmp_path, state):
    """The worker reserves the snapshot after its first step, off the training thread: the
    first save copies into those buffers and allocates nothing more."""
    model, optimizer = state
    saver = AsyncCheckpointer(tmp_path / "c.pt", 2, CPU, lambda *a: None)
    saver.prepare(payload(model, optimizer, 1))
    saver.wait()
    prepared = {k: b.data_ptr() for k, b in saver.snapshot._buffers.items()}
    prepared_bytes = saver.snapshot.nbytes
    assert prepared and prepared_bytes > 0
    saver.submit(payload(model, optimizer, 1), 1)
    saver.wait()
    assert {k: b.data_ptr() for k, b in saver.snapshot._buffers.items()} == prepared
    assert saver.snapshot.nbytes == prepared_bytes
    expected = save_checkpoint(payload(model, optimizer, 1), tmp_path / "sync.pt")
    assert sha256_file(tmp_path / "c.pt") == expected.sha256
