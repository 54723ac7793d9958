"""The worker's merge inbox (fractus/train/merge_inbox.py): a live worker adopts a round's
merged weights in place at a step boundary and goes on from its own next token, optimizer
state, RNG and carried state (bitwise equal to a reference that copies the merged params
into the pre-adoption checkpoint by hand); a restarted worker adopts a newer round before
its first step and never one it already holds; a bad file is refused and changes nothing;
MERGE_INBOX unset is today's worker."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from fractus.config import load_model_config
from fractus.continuous_engine import ContinuousThoughtEngine
from fractus.legacy import _is_carried
from fractus.train.merge_inbox import (MERGED_FORMAT, InboxEntry, MergeRefused, adopt,
                                       read_merged)
from tests.support.worker_utils import (REPO_ROOT, events, load_ckpt, read_jsonl, run_worker,
                                        start_worker, worker_env, write_synth_shard)

TOKENS_PER_STEP = 2 * 16          # TEST_DEFAULTS: BATCH=2, SEQ=16
INBOX = "merge/inbox.json"
ROUND_FILE = "merge/round_00001.pt"

# The reference: the worker's own loop from a checkpoint, the merged params copied in by hand
# between setup and run (no inbox involved).
REFERENCE = """
import os, sys, torch
from fractus.train.env import WorkerSettings
from fractus.train.worker import Worker
worker = Worker(WorkerSettings.from_env(os.environ))
worker.stop.install()
worker.setup()
merged = torch.load(sys.argv[1], map_location="cpu", weights_only=True)["params"]
with torch.no_grad():
    for name, param in worker.model.named_parameters():
        param.copy_(merged[name])
sys.exit(worker.run())
"""


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def merged_from(model_state: dict, seed: int = 7) -> dict:
    """Floating tensors of `model_state` minus carried state, as the launcher's merge writes
    them: learned ones moved (tied names kept equal), constant buffers as they are."""
    model = ContinuousThoughtEngine(**load_model_config("tiny").to_dict())
    learned = dict(model.named_parameters(remove_duplicate=False))
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in model_state.items():
        if _is_carried(name) or not tensor.is_floating_point():
            continue
        out[name] = (tensor + 0.01 * torch.randn(tensor.shape, generator=generator)
                     if name in learned else tensor.clone())
    out["output_head.weight"] = out["observe.weight"]          # tied
    return out


def write_round(pod: Path, params: dict, round_: int = 1, rel: str = ROUND_FILE,
                fmt: str = MERGED_FORMAT, sha: str | None = None) -> InboxEntry:
    path = pod / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": fmt, "round": round_, "params": params}, path)
    entry = InboxEntry(round_, rel, sha or sha256(path))
    return entry


def write_inbox(pod: Path, entry: InboxEntry) -> None:
    tmp = pod / (INBOX + ".tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(json.dumps({"round": entry.round, "path": entry.path,
                               "sha256": entry.sha256}))
    os.replace(tmp, pod / INBOX)


def assert_same_run(a: dict, b: dict) -> None:
    """Bitwise: weights and carried state, SGD momentum, position, EMAs, RNG."""
    assert a["model_state"].keys() == b["model_state"].keys()
    for name, tensor in a["model_state"].items():
        assert torch.equal(tensor, b["model_state"][name]), name
    sa, sb = a["optimizer_state"]["state"], b["optimizer_state"]["state"]
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key]["momentum_buffer"], sb[key]["momentum_buffer"]), key
    ta, tb = a["train_state"], b["train_state"]
    for key in ("next_token", "step", "ema_tf", "ema_ss"):
        assert ta[key] == tb[key], key
    assert torch.equal(ta["rng"]["torch"], tb["rng"]["torch"])
    assert ta["rng"]["python"] == tb["rng"]["python"]


def wait_stopped(proc: subprocess.Popen, timeout: float = 600) -> None:
    """Until the worker has SIGSTOPped itself (FRACTUS_FAULT=pause@N) or exited."""
    deadline = time.monotonic() + timeout
    handle = psutil.Process(proc.pid)
    while handle.status() != psutil.STATUS_STOPPED:
        assert proc.poll() is None, f"the worker exited ({proc.returncode}) before pausing"
        assert time.monotonic() < deadline, "the worker never reached its pause"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A worker trains 3 steps, pauses before step 4 (its step-3 checkpoint on disk), gets
    round 1 in its inbox, adopts it at that boundary and trains to step 6."""
    pod = tmp_path_factory.mktemp("pod")
    write_synth_shard(pod / "shard.npy", tokens=3000)
    env = worker_env(pod, MAX_STEPS=6, SAVE_EVERY=3, ASYNC_SAVE=0, MERGE_INBOX=INBOX,
                     FRACTUS_FAULT="pause@4")
    proc = start_worker(env, cwd=pod, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_stopped(proc)
        pre = pod / "pre.pt"
        shutil.copyfile(env["CKPT_OUT"], pre)
        params = merged_from(load_ckpt(pre)["model_state"])
        entry = write_round(pod, params)
        write_inbox(pod, entry)
        os.kill(proc.pid, signal.SIGCONT)
        assert proc.wait(timeout=600) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    return {"pod": pod, "env": env, "pre": pre, "entry": entry}


@pytest.fixture(scope="module")
def reference(live):
    pod = live["pod"]
    env = worker_env(pod, CKPT_IN=live["pre"], CKPT_OUT=pod / "reference" / "ref.pt",
                     METRICS=pod / "reference.jsonl", MAX_STEPS=3, MERGE_INBOX=None)
    proc = subprocess.run([sys.executable, "-c", REFERENCE, str(pod / ROUND_FILE)], env=env,
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return load_ckpt(pod / "reference" / "ref.pt")


def resumed_run(live, name: str, ckpt: Path, inbox: bool = True, **overrides):
    """A worker started from `ckpt` in its own pod dir beside the live one (the same merge
    files), 3 steps; (its final checkpoint, its records)."""
    pod = live["pod"] / name
    (pod / "merge").mkdir(parents=True)
    for rel in (INBOX, ROUND_FILE):
        shutil.copyfile(live["pod"] / rel, pod / rel)
    env = worker_env(pod, SHARD=live["pod"] / "shard.npy", CKPT_IN=ckpt, MAX_STEPS=3,
                     MERGE_INBOX=INBOX if inbox else None, **overrides)
    proc = run_worker(env, cwd=pod)
    assert proc.returncode == 0, proc.stderr
    return load_ckpt(env["CKPT_OUT"]), read_jsonl(env["METRICS"]), proc


def test_a_live_worker_adopts_at_a_step_boundary_and_goes_on_from_its_own_state(live,
                                                                                reference):
    records = read_jsonl(live["env"]["METRICS"])
    adopted = events(records, "merge_adopted")
    assert [(e["round"], e["at_token"], e["step"]) for e in adopted] == [
        (1, 3 * TOKENS_PER_STEP, 3)]
    assert not events(records, "merge_refused")
    # the pre-adoption checkpoint holds the worker's own trained state (nothing to reset)
    pre = load_ckpt(live["pre"])
    assert "merge_round" not in pre["train_state"] and pre["train_state"]["step"] == 3
    assert all(s["momentum_buffer"].abs().sum() > 0
               for s in pre["optimizer_state"]["state"].values())
    assert pre["model_state"]["thought_state"].abs().sum() > 0
    final = load_ckpt(live["env"]["CKPT_OUT"])
    assert final["train_state"]["merge_round"] == 1 and final["train_state"]["step"] == 6
    # steps 4-6 from the merged weights at token 96, with the worker's own optimizer state,
    # RNG and carried state: the reference resumed those from the step-3 checkpoint
    assert_same_run(final, reference)


def test_a_restarted_worker_adopts_a_newer_round_before_its_first_step(live, reference):
    final, records, _ = resumed_run(live, "restart", live["pre"])
    start = events(records, "start")[0]
    adopted = events(records, "merge_adopted")
    assert [(e["round"], e["at_token"], e["step"]) for e in adopted] == [
        (1, 3 * TOKENS_PER_STEP, 3)]
    assert records.index(adopted[0]) == records.index(start) + 1   # before any step
    assert final["train_state"]["merge_round"] == 1
    assert_same_run(final, reference)


def test_a_round_already_held_is_not_adopted_again(live):
    held = live["env"]["CKPT_OUT"]           # merge_round 1, the inbox still says round 1
    with_inbox, records, _ = resumed_run(live, "held", held)
    assert not events(records, "merge_adopted") and not events(records, "merge_refused")
    without, _, _ = resumed_run(live, "held_unset", held, inbox=False)
    assert_same_run(with_inbox, without)
    assert with_inbox["train_state"]["merge_round"] == 1          # carried on, also unset
    assert without["train_state"]["merge_round"] == 1


def test_unset_merge_inbox_is_todays_worker(live):
    """An inbox file lying in the pod dir is ignored without MERGE_INBOX: no event, no
    merge_round, the weights trained on from the checkpoint as they are."""
    final, records, _ = resumed_run(live, "unset", live["pre"], inbox=False)
    assert not [e for e in events(records) if e["event"].startswith("merge_")]
    assert "merge_round" not in final["train_state"]
    assert events(records, "start")[0]["settings"]["merge_inbox"] is None
    pre = load_ckpt(live["pre"])
    merged = torch.load(live["pod"] / ROUND_FILE, weights_only=True)["params"]
    assert not torch.equal(final["model_state"]["observe.weight"], merged["observe.weight"])
    assert not torch.equal(final["model_state"]["observe.weight"],
                           pre["model_state"]["observe.weight"])     # it trained


def test_a_refused_file_is_reported_and_changes_nothing(live):
    pod = live["pod"] / "refused"
    (pod / "merge").mkdir(parents=True)
    shutil.copyfile(live["pod"] / ROUND_FILE, pod / ROUND_FILE)
    write_inbox(pod, InboxEntry(1, ROUND_FILE, "0" * 64))          # a wrong sha256
    env = worker_env(pod, SHARD=live["pod"] / "shard.npy", CKPT_IN=live["pre"], MAX_STEPS=3,
                     MERGE_INBOX=INBOX)
    proc = run_worker(env, cwd=pod)
    assert proc.returncode == 0, proc.stderr
    refused = events(read_jsonl(env["METRICS"]), "merge_refused")
    assert len(refused) == 1 and refused[0]["round"] == 1 and "sha256" in refused[0]["reason"]
    assert sum("merge round 1 refused" in line for line in proc.stderr.splitlines()) == 1
    assert not events(read_jsonl(env["METRICS"]), "merge_adopted")
    final = load_ckpt(env["CKPT_OUT"])
    assert "merge_round" not in final["train_state"]
    unset, _, _ = resumed_run(live, "refused_unset", live["pre"], inbox=False)
    assert_same_run(final, unset)


# --- the building block in process: in place, and every refusal changes nothing -----------

@pytest.fixture
def trained(tmp_path):
    """A tiny model and SGD after one step (momentum exists), and merged params for it."""
    torch.manual_seed(0)
    model = ContinuousThoughtEngine(**load_model_config("tiny").to_dict())
    model.reset_thought(2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    obs = torch.randint(0, 512, (2, 16))
    loss = (model.hidden(obs)[0].square().mean()           # every parameter gets momentum
            + 1e-3 * sum(p.square().sum() for p in model.parameters()))
    loss.backward()
    optimizer.step()
    return model, optimizer, merged_from(model.state_dict())


def test_adoption_is_in_place_and_keeps_the_optimizer_state(tmp_path, trained):
    model, optimizer, params = trained
    entry = write_round(tmp_path, params)
    before = {n: (id(p), p.data_ptr()) for n, p in model.named_parameters()}
    momentum = {id(p): optimizer.state[p]["momentum_buffer"].clone()
                for p in model.parameters()}
    carry = model.carry_state()
    constants = {n: b.clone() for n, b in model.named_buffers() if not _is_carried(n)}
    adopt(model, read_merged(entry, tmp_path, model))
    assert {n: (id(p), p.data_ptr()) for n, p in model.named_parameters()} == before
    for name, param in model.named_parameters(remove_duplicate=False):
        assert torch.equal(param, params[name]), name
    assert set(optimizer.state) == set(model.parameters())       # the same objects
    for param in model.parameters():
        assert torch.equal(optimizer.state[param]["momentum_buffer"], momentum[id(param)])
    for name, tensor in model.carry_state().items():
        assert torch.equal(tensor, carry[name]), name
    for name, tensor in model.named_buffers():
        if name in constants:
            assert torch.equal(tensor, constants[name]), name


def _bad(params: dict, case: str) -> dict:
    params = dict(params)
    if case == "carried":
        params["blocks.0.attn_S"] = torch.zeros(2, 64, 64)
    elif case == "shape":
        params["observe.weight"] = params["observe.weight"][:-1].clone()
    elif case == "nan":
        bad = params["observe.weight"].clone()
        bad[0, 0] = float("nan")
        params["observe.weight"] = params["output_head.weight"] = bad
    elif case == "missing":
        del params["observe.weight"], params["output_head.weight"]
    elif case == "unknown":
        params["not.a.param"] = torch.zeros(3)
    elif case == "integer":
        params["observe.weight"] = params["observe.weight"].to(torch.int32)
    return params


@pytest.mark.parametrize("case, reason", [
    ("sha256", "sha256"), ("carried", "carried state"), ("shape", "shape"),
    ("nan", "NaN"), ("absolute", "absolute"), ("dotdot", "'..'"), ("missing", "lacks"),
    ("unknown", "not a parameter"), ("integer", "not a dense floating"),
    ("round", "holds round"), ("format", "format"),
])
def test_every_refusal_changes_nothing(tmp_path, trained, case, reason):
    model, optimizer, params = trained
    before = {k: v.clone() for k, v in model.state_dict().items()}
    entry = write_round(tmp_path, _bad(params, case),
                        round_=2 if case == "round" else 1,
                        fmt="something-else" if case == "format" else MERGED_FORMAT)
    if case == "round":
        entry = InboxEntry(1, entry.path, entry.sha256)
    elif case == "sha256":
        entry = InboxEntry(1, entry.path, "f" * 64)
    elif case == "absolute":
        entry = InboxEntry(1, str(tmp_path / ROUND_FILE), entry.sha256)
    elif case == "dotdot":
        entry = InboxEntry(1, f"merge/../../{tmp_path.name}/{ROUND_FILE}", entry.sha256)
    with pytest.raises(MergeRefused) as refused:
        adopt(model, read_merged(entry, tmp_path, model))
    assert reason in refused.value.reason and "\n" not in refused.value.reason
    assert refused.value.round == 1
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


@pytest.mark.parametrize("recorded", [-1, True, "1", 10**10])
def test_a_checkpoint_with_a_bad_merge_round_is_refused(live, tmp_path, capsys, recorded):
    from fractus.train.worker import main
    ck = load_ckpt(live["pre"])
    ck["train_state"]["merge_round"] = recorded
    torch.save(ck, tmp_path / "bad.pt")
    env = worker_env(tmp_path / "out", SHARD=live["pod"] / "shard.npy",
                     CKPT_IN=tmp_path / "bad.pt")
    assert main(env) == 2
    err = capsys.readouterr().err
    assert "merge_round" in err and err.count("\n") == 1


def test_the_inbox_is_read_only_when_it_changes_and_checked(tmp_path):
    from fractus.train.merge_inbox import MergeInbox
    inbox = MergeInbox(INBOX, pod_dir=tmp_path)
    assert inbox.poll() is None                                   # absent
    entry = InboxEntry(3, ROUND_FILE, "a" * 64)
    write_inbox(tmp_path, entry)
    assert inbox.poll() == entry
    assert inbox.poll() is None                                   # unchanged: one stat
    for junk, round_ in [("{not json", None),
                         ('{"round": 0, "path": "x", "sha256": "a"}', None),
                         ('{"round": true, "path": "x", "sha256": "a"}', None),
                         (json.dumps({"round": 4, "path": "x", "sha256": "A" * 64}), 4),
                         (json.dumps({"round": 4, "path": "", "sha256": "a" * 64}), 4)]:
        (tmp_path / INBOX).write_text(junk)
        os.utime(tmp_path / INBOX, ns=(time.time_ns(), time.time_ns()))
        with pytest.raises(MergeRefused) as refused:
            inbox.poll()
        assert refused.value.round == round_
        assert inbox.poll() is None                               # not read again


def test_adoption_does_not_recompile_the_compiled_step(tmp_path):
    """Traced with backend="eager" (dynamo's guards, as tests/test_compile_once.py): after
    an adoption between steps the step stays one graph, no recompile. (Replacing the
    parameters would not recompile either with this torch; what it breaks is the optimizer
    state, which the in-place test above holds.)"""
    from torch._dynamo.utils import counters

    from fractus.nn import attention
    from fractus.train.env import WorkerSettings
    from fractus.train.step import TrainStep
    torch._dynamo.reset()
    counters.clear()
    try:
        attention.set_attention_impl("chunked")
        torch.manual_seed(0)
        model = ContinuousThoughtEngine(**load_model_config("tiny").to_dict())
        model.reset_thought(2)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        settings = WorkerSettings.from_env({"BATCH": "2", "SEQ": "16", "CE_CHUNK": "24",
                                            "SS_RATE": "0"})
        trainer = TrainStep(model, optimizer, settings, torch.device("cpu"))
        trainer.compile(backend="eager")
        generator = torch.Generator().manual_seed(1)
        for step in range(1, 5):
            if step == 3:
                entry = write_round(tmp_path, merged_from(model.state_dict()))
                adopt(model, read_merged(entry, tmp_path, model))
            trainer([(torch.randint(0, 512, (2, 16), generator=generator),
                      torch.randint(0, 512, (2, 16), generator=generator))], step)
        assert trainer.compile_counts() == {"graphs": 1, "graph_breaks": 0, "recompiles": 0}
    finally:
        torch._dynamo.reset()
        counters.clear()
        attention.set_attention_impl(None)
