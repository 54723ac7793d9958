"""The worker's environment contract: every variable, its default, its check and its meaning.

The one list of names the launcher sets and the worker reads, all parsed before anything
is loaded or written (SettingsError: one line, exit 2). v1's (scripts/fast4gpu_boost.py of
AFKmoney/fractus-cte) keep their names and defaults: GPU_ID, BATCH, SEQ, LR, SS_RATE,
SS_PROB, LB_COEF, GATE_TEMP, START_TOKEN, SHARD, CKPT_IN, CKPT_OUT; the rest are v2's.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Callable, Mapping


# Set by the launcher (launcher.child) when a worker's parent-death signal is SIGTERM; read
# by the worker's signal handler (a repeated SIGTERM is then the same launcher death).
PARENT_DEATH_ENV = "FRACTUS_PARENT_DEATH_SIGNAL"


class SettingsError(ValueError):
    """A user mistake in the environment: reported as one line, exit code 2."""




# --- parsers: (variable name, raw string) -> value, raising SettingsError ----------------

def _int_at_least(minimum: int) -> Callable[[str, str], int]:
    def parse(name: str, raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise SettingsError(f"{name} must be an integer >= {minimum}, got {raw!r}")
        return value
    return parse


def _float_in(low: float, high: float, low_open: bool = False) -> Callable[[str, str], float]:
    def parse(name: str, raw: str) -> float:
        try:
            value = float(raw.strip())
        except ValueError:
            value = math.nan
        bad = (not math.isfinite(value) or value > high
               or value < low or (low_open and value == low))
        if bad:
            bound = f"> {low:g}" if low_open else f">= {low:g}"
            upper = "" if math.isinf(high) else f" and <= {high:g}"
            raise SettingsError(f"{name} must be a number {bound}{upper}, got {raw!r}")
        return value
    return parse


def _flag(name: str, raw: str) -> bool:
    if raw.strip() in ("0", "1"):
        return raw.strip() == "1"
    raise SettingsError(f"{name} must be 0 or 1, got {raw!r}")


def _text(name: str, raw: str) -> str:
    if not raw.strip():
        raise SettingsError(f"{name} must not be empty when set")
    return raw.strip()


def _attn_impl(name: str, raw: str) -> str:
    # The engine's registry is the one list of names (registered test kernels included), so a
    # typo fails here, before the model is built.
    from fractus.nn import attention
    if raw.strip() not in attention.ATTENTION_IMPLS:
        raise SettingsError(f"{name} must be one of {', '.join(attention.ATTENTION_IMPLS)}, got {raw!r}")
    return raw.strip()


def _device(name: str, raw: str) -> str:
    value = raw.strip()
    if value == "cpu" or value == "cuda" or (value.startswith("cuda:") and value[5:].isdigit()):
        return value
    raise SettingsError(f"{name} must be cpu, cuda or cuda:N, got {raw!r}")


def _fault(name: str, raw: str) -> str:
    from fractus.train.faults import parse_fault  # the fault grammar lives with the injector
    try:
        parse_fault(raw)
    except ValueError as e:
        raise SettingsError(f"{name} {e}, got {raw!r}") from None
    return raw.strip()


def _var(env: str, default, parse, doc: str, shown: str | None = None):
    """A field bound to one variable; `doc` and `shown` (the default as people read it) are
    its row of docs/WORKER.md's table (env_table)."""
    return field(default=default, metadata={"env": env, "parse": parse, "doc": doc,
                                            "shown": shown})


@dataclass(frozen=True)
class WorkerSettings:
    gpu_id: int = _var("GPU_ID", 0, _int_at_least(0),
                       "index of this worker: names its shard, checkpoint, seed")
    start_token: int | None = _var("START_TOKEN", None, _int_at_least(0),
                                   "first token to train on, exactly (no rounding). Required "
                                   "with a weights-only `CKPT_IN`; must equal a full "
                                   "checkpoint's `next_token` unless `FORCE_START_TOKEN=1`; 0 "
                                   "for a fresh model")
    batch: int = _var("BATCH", 4, _int_at_least(1), "rows per batch")
    seq: int = _var("SEQ", 128, _int_at_least(1), "tokens per row")
    lr: float = _var("LR", 7e-4, _float_in(0.0, math.inf, low_open=True),
                     "SGD learning rate (momentum 0.9). Not restored from the checkpoint: the "
                     "setting wins",
                     shown="7e-4")
    ss_rate: float = _var("SS_RATE", 0.25, _float_in(0.0, 1.0),
                          "probability of a scheduled-sampling pass per batch")
    ss_prob: float = _var("SS_PROB", 0.2, _float_in(0.0, 1.0),
                          "per-position replacement probability in the SS pass")
    lb_coef: float = _var("LB_COEF", 0.02, _float_in(0.0, math.inf), "load-balance weight")
    gate_temp: float = _var("GATE_TEMP", 2.5, _float_in(0.0, math.inf, low_open=True),
                            "MoE gate temperature")
    ce_chunk: int = _var("CE_CHUNK", 0, _int_at_least(0),
                         "0: dense reference CE; >0: chunked CE and chunked SS sampling")
    attn_impl: str | None = _var("FRACTUS_ATTN_IMPL", None, _attn_impl,
                                 "`einsum`, `cumsum` or `chunked` (or a kernel registered "
                                 "with `fractus.nn.attention`): the engine's kernel, set by the "
                                 "worker before it builds the model",
                                 shown="the engine's: `cumsum` on CPU, `chunked` on CUDA")
    compile: bool = _var("COMPILE", False, _flag,
                         "1: `torch.compile` the model's chunk functions")
    bf16: bool | None = _var("BF16", None, _flag,
                             "1: the forward under bf16 autocast (`torch.autocast` on the "
                             "worker's device, CUDA or CPU); 0: float32",
                             shown="1 on CUDA (v1's), 0 on CPU")
    accum: int = _var("ACCUM", 1, _int_at_least(1),
                      "batches per optimizer step (1 = the reference step)")
    shard: str | None = _var("SHARD", None, _text,
                             "token shard: a 1-D integer `.pt` tensor, or a `.npy` of any "
                             "integer dtype (memmapped; each window widened to int32/int64, "
                             "never the whole shard). A missing `.pt` falls back to the same "
                             "path with `.npy`, as v1",
                             shown="`data/shard_gpu{GPU_ID}.pt` (v1's)")
    ckpt_in: str | None = _var("CKPT_IN", None, _text,
                               "checkpoint to start from: full, v1 weights-only "
                               '`{"model_state", "config"}`, or a bare state_dict (config from '
                               "`MODEL`)",
                               shown="(none: see below)")
    ckpt_out: str | None = _var("CKPT_OUT", None, _text,
                                "checkpoint written; resumed from when `CKPT_IN` is unset and "
                                "it exists",
                                shown="`checkpoints/fractus_1b_gpu{GPU_ID}.pt`")
    model: str | None = _var("MODEL", None, _text,
                             "preset (`1b`, `small`, `tiny`) or a `.json`/`.yaml` of "
                             "constructor keywords. When resuming, the checkpoint's config is "
                             "used; an explicit `MODEL` that disagrees is refused",
                             shown="`1b`")
    device: str | None = _var("DEVICE", None, _device,
                              "`cpu`, `cuda` or `cuda:N`",
                              shown="`cuda` if available, else `cpu`")
    max_steps: int = _var("MAX_STEPS", 0, _int_at_least(0),
                          "optimizer steps in this run; 0 = to the end of the shard")
    save_every: int = _var("SAVE_EVERY", 800, _int_at_least(0),
                           "checkpoint every N steps (0 = only at the end)")
    save_keep: int = _var("SAVE_KEEP", 3, _int_at_least(1),
                          "checkpoints kept per GPU (canonical file + `SAVE_KEEP-1` copies)")
    async_save: bool = _var("ASYNC_SAVE", True, _flag,
                            "1: snapshot at the step boundary, write the checkpoint in the "
                            "background (below). 0: write it on the training thread")
    log_every: int = _var("LOG_EVERY", 40, _int_at_least(1),
                          "metrics line and human line every N steps, at the first step of "
                          "every run, and at its last step (the final checkpoint's)")
    metrics: str | None = _var("METRICS", None, _text,
                               "JSON-lines file for metrics and events (appended)",
                               shown="(none: no file)")
    tb_dir: str | None = _var("TB_DIR", None, _text,
                              "TensorBoard run directory: every metrics line also as scalars "
                              "(below); the launcher sets `logs/tb/gpu{i}`",
                              shown="(none: no files)")
    stage: int | None = _var("STAGE", None, _int_at_least(1),
                             "the pod stage of this run: the TensorBoard `stage` scalar, and "
                             "the stage a merge round inbox entry must name to decide a "
                             "boundary; set by the launcher")
    seed: int | None = _var("SEED", None, _int_at_least(0),
                            "seeds torch and python `random` (v1 seeded torch with 42 + GPU_ID "
                            "and left `random` unseeded)",
                            shown="42 + `GPU_ID`")
    run_id: str | None = _var("RUN_ID", None, _text,
                              "identity of the run, recorded in each checkpoint "
                              "(`train_state.run_id`); the launcher sets it from the "
                              "manifest's `run_id`")
    phase: int = _var("PHASE", 1, _int_at_least(1),
                      "the data phase `SHARD` belongs to (1-based), recorded in each "
                      "checkpoint (`train_state.phase`) and `checkpoint` event. A full "
                      "checkpoint of phase `PHASE-1` with `START_TOKEN=0` starts this phase at "
                      "token 0 of `SHARD` with its weights, optimizer state, carry and RNG "
                      "(the launcher's phase switch; no warning); a checkpoint of any other "
                      "phase is refused (exit 2)")
    force_start_token: bool = _var("FORCE_START_TOKEN", False, _flag,
                                   "1: accept a `START_TOKEN` that disagrees with the full "
                                   "checkpoint")
    allow_fresh_start: bool = _var("ALLOW_FRESH_START", False, _flag,
                                   "1: train a new random model when there is no checkpoint to "
                                   "start from (the `tiny-cpu` demo preset sets it); otherwise "
                                   "that is refused (exit 2)")
    merge_inbox: str | None = _var("MERGE_INBOX", None, _text,
                                   "merge rounds' inbox, a JSON file inside the pod dir (the "
                                   "working directory): checked at each step boundary and at "
                                   "start; a newer round's merged weights are adopted in "
                                   "place (below). Set by the launcher only when rounds are on",
                                   shown="(none: no rounds)")
    merge_every: int = _var("MERGE_EVERY", 0, _int_at_least(0),
                            "merge rounds: tokens between two round boundaries (0: none); "
                            "at each the worker saves, says `merge_wait` and waits for the "
                            "round's decision in MERGE_INBOX. Set by the launcher")
    merge_origin: int = _var("MERGE_ORIGIN", 0, _int_at_least(0),
                             "merge rounds: the token boundary k counts from (boundary k: "
                             "the first step boundary at or past MERGE_ORIGIN + "
                             "k * MERGE_EVERY). Set by the launcher")
    fault: str | None = _var("FRACTUS_FAULT", None, _fault, "tests only, see below")

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "WorkerSettings":
        """Parse every variable; unset or empty means the default."""
        values = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(f.metadata["env"])
            if raw is None or raw == "":
                continue
            values[f.name] = f.metadata["parse"](f.metadata["env"], raw)
        if values.get("merge_every") and not values.get("merge_inbox"):
            raise SettingsError("MERGE_EVERY needs MERGE_INBOX, where the worker reads each "
                                "round's decision; set both, or neither")
        return cls(**values)

    # Defaults that depend on GPU_ID (kept as properties so the raw settings stay as given).
    @property
    def shard_path(self) -> str:
        """SHARD, else v1's default; a missing .pt falls back to its .npy twin (as v1)."""
        path = self.shard or f"data/shard_gpu{self.gpu_id}.pt"
        if path.endswith(".pt") and not os.path.exists(path):
            twin = path[:-len(".pt")] + ".npy"
            if os.path.exists(twin):
                return twin
        return path

    @property
    def ckpt_out_path(self) -> str:
        return self.ckpt_out or f"checkpoints/fractus_1b_gpu{self.gpu_id}.pt"

    @property
    def effective_seed(self) -> int:
        return self.seed if self.seed is not None else 42 + self.gpu_id

    @property
    def tokens_per_batch(self) -> int:
        return self.batch * self.seq

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq * self.accum

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Every variable the worker reads, for the launcher (which must not invent its own list).
ENV_VARS: tuple[str, ...] = tuple(f.metadata["env"] for f in dataclasses.fields(WorkerSettings))
# v1's CKPT_IN fallback after CKPT_OUT; here, in the light module resume.py and adoption import.
MERGED_BRAIN = "checkpoints/FRACTUS_1B_STAGE2_MERGED.pt"
# The variables that name files (read or written by the worker): a pod rebuilt from a hub
# takes them only inside the pod (launcher/hub/config_trust.py).
PATH_VARS: tuple[str, ...] = ("SHARD", "CKPT_IN", "CKPT_OUT", "METRICS", "TB_DIR", "MODEL",
                             "MERGE_INBOX")
assert set(PATH_VARS) <= set(ENV_VARS)


def env_table() -> str:
    """docs/WORKER.md's "Environment" table (tests/test_worker_docs.py checks it); paste
    `python -c "from fractus.train.env import env_table as t; print(t())"` after a change."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(WorkerSettings):
        shown = f.metadata["shown"]
        if shown is None:
            shown = ("(none)" if f.default is None else str(int(f.default))
                     if isinstance(f.default, bool) else str(f.default))
        rows.append(f"| `{f.metadata['env']}` | {shown} | {f.metadata['doc']} |")
    return "\n".join(rows) + "\n"
