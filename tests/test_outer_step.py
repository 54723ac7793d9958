"""launcher.hub.outer_step: a merge round's weighted mean, outer step and files."""

import dataclasses
import gc
import io
import weakref
from pathlib import Path

import pytest
import torch

import launcher.hub.merge as merge_module
import launcher.hub.outer_step as outer_module
from fractus.config import PRESETS
from fractus.continuous_engine import ContinuousThoughtEngine
from launcher.files import sha256_file
from launcher.hub.merge import NotFinite, is_carried_state, stream_mean
from launcher.hub.outer_step import (MERGED_FORMAT, OUTER_FORMAT, OuterSettings,
                                     commit_outer_state, outer_step, read_outer_state)
from launcher.paths import OUTER_STATE_FILE, OUTER_STATE_PENDING, merged_round_path

MEAN = OuterSettings("mean")
NESTEROV = OuterSettings("nesterov", lr=0.7, momentum=0.9)


def _tiny_checkpoints(pod: Path, n: int, seed: int = 0) -> list[Path]:
    """n GPUs' checkpoints of the tiny preset, as the worker saves them: a differently seeded
    model each (tied head, carried state, integer-free)."""
    paths = []
    for gpu in range(n):
        torch.manual_seed(seed * 100 + gpu)
        model = ContinuousThoughtEngine.from_config(PRESETS["tiny"])
        path = pod / "checkpoints" / f"fractus_1b_gpu{gpu}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model_state": model.state_dict(),
                    "config": dataclasses.asdict(PRESETS["tiny"]),
                    "train_state": {"gpu": gpu, "next_token": 640 * (seed + 1)},
                    "optimizer_state": {}}, path)
        paths.append(path)
    return paths


def _small(path: Path, w: list[float]) -> Path:
    """A checkpoint with one parameter `w`, a carried buffer and an integer buffer."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model_state": {"w": torch.tensor(w, dtype=torch.float32),
                                "thought_state": torch.randn(1, 1, 2),
                                "step_counter": torch.tensor(7)}, "config": {}}, path)
    return path


def _load(path) -> dict:
    return torch.load(path, weights_only=True)


def _files(pod: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((pod / "merge").glob("*"))} \
        if (pod / "merge").is_dir() else {}


def _assert_bitwise(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def test_mean_is_nesterov_at_lr_1_momentum_0_bitwise_and_exactly_the_mean(tmp_path):
    pods = {}
    for name, settings in (("mean", MEAN), ("nesterov", OuterSettings("nesterov", 1.0, 0.0))):
        pod = tmp_path / name
        outer_step(pod, 1, _tiny_checkpoints(pod, 3, seed=0), settings)
        report = outer_step(pod, 2, _tiny_checkpoints(pod, 3, seed=1), settings,
                            weights=[5, 2, 1])
        pods[name] = (pod, report)
    (a, ra), (b, rb) = pods["mean"], pods["nesterov"]
    assert ra.sha256 == rb.sha256     # the round files are the same bytes
    _assert_bitwise(_load(a / merged_round_path(2))["params"],
                    _load(b / merged_round_path(2))["params"])
    sa, sb = _load(a / OUTER_STATE_FILE), _load(b / OUTER_STATE_FILE)
    _assert_bitwise(sa["outer"], sb["outer"])
    _assert_bitwise(sa["momentum"], sb["momentum"])
    # Not outer - (outer - mean), which rounds: the weighted mean itself, bit for bit.
    mean = stream_mean(_tiny_checkpoints(tmp_path / "again", 3, seed=1), [5, 2, 1])
    for key, t in mean.means.items():
        assert torch.equal(sa["outer"][key], t), key


def test_first_round_outer_is_the_weighted_mean_momentum_zero(tmp_path):
    pod = tmp_path / "pod"
    sources = _tiny_checkpoints(pod, 3)
    report = outer_step(pod, 1, sources, NESTEROV, weights=[300, 100, 0])

    assert (report.round, report.n_gpus, report.weights) == (1, 3, (0.75, 0.25, 0.0))
    assert report.committed and report.sha256 == sha256_file(pod / merged_round_path(1))
    assert report.bytes_written == sum(p.stat().st_size for p in (pod / "merge").iterdir())
    state = read_outer_state(pod / OUTER_STATE_FILE, expect_round=1)
    assert state.settings == NESTEROV
    models = [_load(p)["model_state"] for p in sources]
    names = [k for k, t in models[0].items() if t.is_floating_point() and not is_carried_state(k)]
    assert list(state.outer) == names and report.tensors == len(names)
    for key in names:
        expected = (0.75 * models[0][key].double() + 0.25 * models[1][key].double()).float()
        torch.testing.assert_close(state.outer[key], expected, rtol=1e-6, atol=1e-7)
        assert not state.momentum[key].any(), key
    merged = _load(pod / merged_round_path(1))
    assert set(merged) == {"format", "round", "params"}
    assert (merged["format"], merged["round"]) == (MERGED_FORMAT, 1)
    _assert_bitwise(merged["params"], state.outer)     # float32 parameters: the outer weights
    # The tied head stays tied in both files; carried state is no parameter.
    assert merged["params"]["output_head.weight"].data_ptr() == \
        merged["params"]["observe.weight"].data_ptr()
    assert "thought_state" not in merged["params"] and "blocks.0.attn_S" not in state.outer


def test_three_rounds_of_nesterov_by_hand(tmp_path):
    pod, s = tmp_path / "pod", OuterSettings("nesterov", lr=0.5, momentum=0.5)
    # Round 1: mean [2, 3] -> outer [2, 3], m 0.
    outer_step(pod, 1, [_small(tmp_path / "a1.pt", [1, 2]), _small(tmp_path / "b1.pt", [3, 4])], s)
    # Round 2, weights 1:2: mean (1*[0,3] + 2*[3,0]) / 3 = [2, 1]; g = [0, 2]; m = [0, 2];
    # outer = [2, 3] - 0.5*([0, 2] + 0.5*[0, 2]) = [2, 1.5].
    outer_step(pod, 2, [_small(tmp_path / "a2.pt", [0, 3]), _small(tmp_path / "b2.pt", [3, 0])],
               s, weights=[1, 2])
    state = _load(pod / OUTER_STATE_FILE)
    assert torch.equal(state["outer"]["w"], torch.tensor([2.0, 1.5]))
    assert torch.equal(state["momentum"]["w"], torch.tensor([0.0, 2.0]))
    # Round 3: mean [1, 1]; g = [1, 0.5]; m = 0.5*[0, 2] + g = [1, 1.5];
    # outer = [2, 1.5] - 0.5*([1, 0.5] + 0.5*[1, 1.5]) = [1.25, 0.875].
    report = outer_step(pod, 3, [_small(tmp_path / "a3.pt", [1, 1]),
                                 _small(tmp_path / "b3.pt", [1, 1])], s)
    state = _load(pod / OUTER_STATE_FILE)
    assert state["round"] == 3 and state["format"] == OUTER_FORMAT
    assert torch.equal(state["outer"]["w"], torch.tensor([1.25, 0.875]))
    assert torch.equal(state["momentum"]["w"], torch.tensor([1.0, 1.5]))
    assert torch.equal(_load(report.merged_path)["params"]["w"], torch.tensor([1.25, 0.875]))
    assert list(state["outer"]) == ["w"]        # no carried state, no integer buffer


def test_token_weights_and_their_refusals(tmp_path):
    paths = _tiny_checkpoints(tmp_path, 3)
    equal, even, skewed = (stream_mean(paths), stream_mean(paths, [7, 7, 7]),
                           stream_mean(paths, [1, 0, 3]))
    _assert_bitwise(equal.means, even.means)    # equal token counts: the plain mean
    models = [_load(p)["model_state"] for p in paths]
    for key, t in skewed.means.items():
        expected = (models[0][key].double() + 3 * models[2][key].double()) / 4
        torch.testing.assert_close(t, expected.float(), rtol=1e-6, atol=1e-7)
    pod = tmp_path / "pod"
    for bad in ([0, 0, 0], [1, -1, 1], [1, 1], [1, float("nan"), 1], [True, 1, 1]):
        with pytest.raises(ValueError, match="merge weight"):
            outer_step(pod, 1, paths, MEAN, weights=bad)
    assert not (pod / "merge").exists()


def test_one_checkpoint_loaded_at_a_time(tmp_path, monkeypatch):
    pod = tmp_path / "pod"
    outer_step(pod, 1, _tiny_checkpoints(pod, 4, seed=0), NESTEROV)
    sources = _tiny_checkpoints(pod, 4, seed=1)
    alive_at_each_load, loaded = [], []
    real = merge_module.read_checkpoint

    def counting(path, **kwargs):
        gc.collect()
        alive_at_each_load.append(sum(1 for refs in loaded if any(r() is not None for r in refs)))
        ckpt = real(path, **kwargs)
        loaded.append([weakref.ref(t) for t in ckpt["model_state"].values()])
        return ckpt

    monkeypatch.setattr(merge_module, "read_checkpoint", counting)
    outer_step(pod, 2, sources, NESTEROV)
    gc.collect()
    assert len(loaded) == 4
    assert alive_at_each_load == [0, 0, 0, 0]   # each checkpoint released before the next
    assert not any(r() is not None for refs in loaded for r in refs)


def test_nan_is_refused_and_nothing_written(tmp_path):
    pod = tmp_path / "pod"
    outer_step(pod, 1, _tiny_checkpoints(pod, 2, seed=0), NESTEROV)
    before = _files(pod)
    sources = _tiny_checkpoints(pod, 2, seed=1)
    ckpt = _load(sources[1])
    ckpt["model_state"]["blocks.1.moe.U1"][0, 0, 0] = float("nan")
    torch.save(ckpt, sources[1])
    with pytest.raises(NotFinite, match="blocks.1.moe.U1 holds NaN or Inf"):
        outer_step(pod, 2, sources, NESTEROV)
    assert _files(pod) == before
    # An outer state holding Inf is refused the same way.
    state = _load(pod / OUTER_STATE_FILE)
    state["momentum"]["observe.weight"][0, 0] = float("inf")
    torch.save(state, pod / OUTER_STATE_FILE)
    before = _files(pod)
    with pytest.raises(NotFinite, match="momentum observe.weight holds NaN or Inf"):
        outer_step(pod, 2, _tiny_checkpoints(pod, 2, seed=1), NESTEROV)
    assert _files(pod) == before


def test_crash_between_the_writes_keeps_the_outer_state_and_the_rerun_is_bitwise(
        tmp_path, monkeypatch):
    clean, crashed = tmp_path / "clean", tmp_path / "crashed"
    for pod in (clean, crashed):
        outer_step(pod, 1, _tiny_checkpoints(pod, 3, seed=0), NESTEROV)
    outer_step(clean, 2, _tiny_checkpoints(clean, 3, seed=1), NESTEROV)
    round1_state = (crashed / OUTER_STATE_FILE).read_bytes()

    real, calls = outer_module.atomic_write_with, []

    def second_write_dies(path, write, *args):
        calls.append(path)
        if len(calls) == 2:
            def torn(f):
                f.write(b"half an outer state")
                raise OSError("killed mid-write")
            return real(path, torn, *args)
        return real(path, write, *args)

    monkeypatch.setattr(outer_module, "atomic_write_with", second_write_dies)
    sources = _tiny_checkpoints(crashed, 3, seed=1)
    with pytest.raises(OSError, match="killed mid-write"):
        outer_step(crashed, 2, sources, NESTEROV)
    assert calls == [crashed / merged_round_path(2), crashed / OUTER_STATE_FILE]
    assert (crashed / OUTER_STATE_FILE).read_bytes() == round1_state
    assert sorted(_files(crashed)) == ["outer_state.pt", "round_00001.pt", "round_00002.pt"]
    monkeypatch.undo()

    outer_step(crashed, 2, sources, NESTEROV)
    assert _files(crashed) == _files(clean)     # the round is a function of its inputs


def test_outer_state_reloads_exactly(tmp_path):
    pod = tmp_path / "pod"
    outer_step(pod, 1, _tiny_checkpoints(pod, 2, seed=0), NESTEROV)
    outer_step(pod, 2, _tiny_checkpoints(pod, 2, seed=1), NESTEROV)
    path = pod / OUTER_STATE_FILE
    state = read_outer_state(path, expect_round=2)
    again = io.BytesIO()     # saved again as outer_step saves it: to a file object
    torch.save({"format": OUTER_FORMAT, "round": state.round, "outer": state.outer,
                "momentum": state.momentum, "settings": state.settings.to_dict()}, again)
    assert again.getvalue() == path.read_bytes()
    assert state.momentum["observe.weight"].any()   # round 2 moved the momentum
    assert state.outer["output_head.weight"].data_ptr() == state.outer["observe.weight"].data_ptr()


def _rewritten(path: Path, change) -> None:
    state = _load(path)
    change(state)
    torch.save(state, path)


@pytest.mark.parametrize("change, message", [
    (lambda s: s.update(format="fractus-pod-outer-v0"), "is not a fractus-pod-outer-v1"),
    (lambda s: s.update(round=2), "is round 2's outer state, expected round 1's"),
    (lambda s: s.update(round=True), "round True is not an integer"),
    (lambda s: s.update(extra=1), "is not a fractus-pod-outer-v1"),
    (lambda s: s["outer"].pop("confidence_head.bias"), "outer and momentum name different"),
    (lambda s: [s[p].update(extra=torch.zeros(1)) for p in ("outer", "momentum")],
     r"does not match the checkpoints: extra \['extra'\]"),
    (lambda s: [s[p].update({"confidence_head.bias": torch.zeros(2)})
                for p in ("outer", "momentum")], r"confidence_head.bias is \(2,\)"),
    (lambda s: s["settings"].update(lr=3.0), "outer lr 3.0 is not in"),
    (lambda s: s.update(outer=[1]), "outer is not a dict of floating tensors"),
])
def test_a_bad_outer_state_is_refused_in_one_line(tmp_path, change, message):
    pod = tmp_path / "pod"
    outer_step(pod, 1, _tiny_checkpoints(pod, 2, seed=0), NESTEROV)
    _rewritten(pod / OUTER_STATE_FILE, change)
    before = _files(pod)
    with pytest.raises(ValueError, match=message) as info:
        outer_step(pod, 2, _tiny_checkpoints(pod, 2, seed=1), NESTEROV)
    assert "\n" not in str(info.value)
    assert _files(pod) == before


def test_outer_state_with_code_or_missing_is_refused(tmp_path):
    pod = tmp_path / "pod"
    with pytest.raises(ValueError, match="needs round 1's outer state"):
        outer_step(pod, 2, _tiny_checkpoints(pod, 2), MEAN)
    (pod / "merge").mkdir()
    torch.save({"format": OUTER_FORMAT, "settings": dataclasses.replace(MEAN)},
               pod / OUTER_STATE_FILE)       # a pickled object: weights_only refuses it
    with pytest.raises(ValueError, match="cannot load checkpoint"):
        outer_step(pod, 2, _tiny_checkpoints(pod, 2), MEAN)
    assert sorted(_files(pod)) == ["outer_state.pt"]


def test_candidate_outer_state_waits_for_its_commit(tmp_path):
    pod = tmp_path / "pod"
    outer_step(pod, 1, _tiny_checkpoints(pod, 2, seed=0), NESTEROV)
    round1 = (pod / OUTER_STATE_FILE).read_bytes()
    report = outer_step(pod, 2, _tiny_checkpoints(pod, 2, seed=1), NESTEROV, commit=False)
    assert not report.committed and report.outer_state_path == pod / OUTER_STATE_PENDING
    assert (pod / OUTER_STATE_FILE).read_bytes() == round1     # a gate may still refuse it
    candidate = (pod / OUTER_STATE_PENDING).read_bytes()
    with pytest.raises(ValueError, match="is round 2's outer state, expected round 3's"):
        commit_outer_state(pod, 3)
    assert commit_outer_state(pod, 2) == pod / OUTER_STATE_FILE
    assert (pod / OUTER_STATE_FILE).read_bytes() == candidate
    assert not (pod / OUTER_STATE_PENDING).exists()
    with pytest.raises(ValueError, match="no candidate outer state"):
        commit_outer_state(pod, 2)


@pytest.mark.parametrize("args, message", [
    (("adam",), "is not one of mean, nesterov"),
    (("nesterov", 0.0, 0.9), r"lr 0.0 is not in \(0, 2\]"),
    (("nesterov", 2.5, 0.9), r"lr 2.5 is not in \(0, 2\]"),
    (("nesterov", 0.7, 1.0), r"momentum 1.0 is not in \[0, 1\)"),
    (("nesterov", 0.7, -0.1), r"momentum -0.1 is not in \[0, 1\)"),
    (("nesterov", float("nan"), 0.9), "lr nan is not a finite number"),
    (("nesterov", True, 0.9), "lr True is not a finite number"),
    (("mean", 0.7, 0.0), "`mean` is lr 1 and momentum 0"),
])
def test_outer_settings_are_range_checked(args, message):
    with pytest.raises(ValueError, match=message):
        OuterSettings(*args)
    assert OuterSettings("nesterov", 2, 0) == OuterSettings("nesterov", 2.0, 0.0)
