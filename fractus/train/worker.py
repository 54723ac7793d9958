"""The per-GPU worker: one process, one shard, one checkpoint file (no torch.distributed).

Setup (all checks before anything is written) -> resume -> loop -> final checkpoint.
How to run it, its environment (train/env.py) and exit codes: docs/WORKER.md.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import psutil
import torch

from fractus.continuous_engine import check_token_ids
from fractus.data import ShardError, TokenShard, batch_from_window
from fractus.nn import attention
from fractus.train.async_save import AsyncCheckpointer, SaveTiming
from fractus.train.checkpoint import (NonFiniteCheckpointError, capture_rng, remove_stale_temps,
                                      restore_rng, save_checkpoint, training_payload)
from fractus.train.disk import describe_disk_full, no_space_error
from fractus.train.env import PARENT_DEATH_ENV, SettingsError, WorkerSettings
from fractus.train.exit_codes import WorkerExitCode
from fractus.train.faults import FaultInjector, parse_fault
from fractus.train.merge_inbox import (MergeInbox, MergeRefused, adopt, file_sha256,
                                       read_merged)
from fractus.train.metrics import MetricsWriter, human_line
from fractus.train.resume import build_model, find_start, resolve_device
from fractus.train.step import NonFiniteError, TrainStep, compiled_divergence
from fractus.train.tensorboard import TensorBoardScalars

EMA_BETA = 0.98
MERGE_POLL_S = 0.2     # how often a worker waiting at a round boundary reads its inbox


def ema(previous: float | None, value: float) -> float:
    return value if previous is None else EMA_BETA * previous + (1 - EMA_BETA) * value


class StoppedBeforeProgress(BaseException):
    """A stop before the first step (a BaseException: no crash handler takes it)."""


class StopSignal:
    """First SIGTERM/SIGINT: finish the step, checkpoint, exit 0 (before the first step: exit
    0 at once); a second exits at once unless it is a repeated parent-death SIGTERM
    (docs/WORKER.md, "Exit codes and signals")."""

    def __init__(self, environ=None, label: str = "worker"):
        environ = os.environ if environ is None else environ
        self.label = label                  # "GPU i": the prefix of the worker's lines
        self.requested: str | None = None
        self.repeated_sigterm_is_parent_death = (
            environ.get(PARENT_DEATH_ENV) == signal.SIGTERM.name)
        self.progressed = False

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.requested is not None:
            if signum == signal.SIGTERM and self.repeated_sigterm_is_parent_death:
                return          # the same launcher death again: the save goes on
            os._exit(128 + signum)
        self.requested = signal.Signals(signum).name
        if not self.progressed:
            raise StoppedBeforeProgress(self.requested)
        # Said at once: finishing and saving can take minutes. os.write: a print here could
        # re-enter a print it interrupted.
        os.write(2, f"{self.label}: {self.requested}: finishing the step, then a checkpoint; "
                    f"a second signal exits at once without one\n".encode())


class Worker:
    def __init__(self, settings: WorkerSettings):
        self.s = settings
        self.stop = StopSignal(label=f"GPU {settings.gpu_id}")

    # --- setup: no writes until every check has passed ----------------------------------
    def setup(self) -> None:
        s = self.s
        self.device = resolve_device(s)
        # From the parsed settings, not the engine's own os.environ read (kept for scripts).
        attention.set_attention_impl(s.attn_impl or attention.default_impl_for(self.device.type))
        self.shard = TokenShard(s.shard_path)
        self.start = find_start(s, len(self.shard))
        torch.manual_seed(s.effective_seed)
        random.seed(s.effective_seed)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self.model, self.stored_batch = build_model(self.start, s.batch, self.device)
        self.model.set_gate_temperature(s.gate_temp)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=s.lr, momentum=0.9)
        if self.start.kind == "full":
            self.optimizer.load_state_dict(self.start.checkpoint["optimizer_state"])
            for group in self.optimizer.param_groups:  # LR is a setting, not restored state
                group["lr"] = s.lr
            restore_rng(self.start.rng, self.device)
        self.start.checkpoint = None  # drop the CPU copy of the weights
        self.faults = FaultInjector(parse_fault(s.fault))
        self.trainer = TrainStep(self.model, self.optimizer, s, self.device, self.faults)
        self.next_token = self.start.next_token
        self.step = self.start.step
        self.ema_tf, self.ema_ss = self.start.ema_tf, self.start.ema_ss
        self.ckpt_out = Path(s.ckpt_out_path)
        same_file = self.start.source and Path(self.start.source).resolve() == self.ckpt_out.resolve()
        self.saved_step = self.step if self.start.kind == "full" and same_file else None
        self.merge_round = self.start.merge_round
        self.last_saved: tuple | None = None   # (path, sha256) of the newest durable save
        # Unset (today, and whenever rounds are off): no inbox, one `if` per step.
        self.merge_inbox = (MergeInbox(s.merge_inbox, pod_dir=Path.cwd())
                            if s.merge_inbox else None)

    # --- per-step pieces ------------------------------------------------------------------
    def _batch(self, position: int):
        """v1's slice: tokens [p, p+B*SEQ+1), checked on the host, cast to long on the device."""
        n = self.s.tokens_per_batch
        window = self.shard.window(position, n + 1)
        try:
            check_token_ids(window, self.model.config.vocab_size)
        except ValueError as e:
            raise ShardError(f"shard {self.shard.path} at token {position}: {e}") from None
        window = window.to(self.device, non_blocking=True)
        return batch_from_window(window, self.s.batch, self.s.seq)

    def _mem_gb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 1e9
        # Peak RSS (v1's max_memory_allocated on CPU). VmHWM, not ru_maxrss: Linux carries
        # ru_maxrss over fork and exec, so a large parent's peak would be reported.
        try:
            with open("/proc/self/status") as status:
                for line in status:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024 / 1e9   # kB
        except OSError:
            pass
        return psutil.Process().memory_info().rss / 1e9

    def _payload(self) -> dict:
        return training_payload(self.model, self.optimizer, self.s, next_token=self.next_token,
                                step=self.step, ema_tf=self.ema_tf, ema_ss=self.ema_ss,
                                device=self.device, shard=str(self.shard.path),
                                merge_round=self.merge_round)

    def _save(self) -> None:
        """Checkpoint this step, in the background (ASYNC_SAVE=1) or on this thread."""
        t0 = time.perf_counter()
        payload = self._payload()
        numbers = {"next_token": self.next_token, "phase": self.s.phase, "step": self.step,
                   "ema_tf": self.ema_tf, "ema_ss": self.ema_ss, "lb": self.last_lb}
        if self.saver is not None:
            self.saver.submit(payload, numbers)
        else:
            saved = save_checkpoint(payload, self.ckpt_out, keep=self.s.save_keep,
                                    on_write=self.faults.save_write_hook(self.step))
            seconds = time.perf_counter() - t0
            self._on_durable(saved, numbers, SaveTiming(stall_s=seconds, seconds=seconds))
        self.saved_step = self.step

    def _on_durable(self, saved, numbers: dict, timing: SaveTiming) -> None:
        """Runs once the file is on disk (on the writer thread when saving in the background)."""
        self.last_saved = (saved.path, saved.sha256)
        self.faults.after_save(numbers["step"])
        self.log.event("checkpoint", path=saved.path, sha256=saved.sha256, bytes=saved.bytes,
                       mtime_ns=saved.mtime_ns, **numbers, seconds=timing.seconds,
                       stall_s=timing.stall_s)
        with self.stdout_lock:
            print(f"GPU {self.s.gpu_id}: saved -> {saved.path} "
                  f"(next_token={numbers['next_token']})", flush=True)

    def _settle_saves(self) -> None:
        """Land the save in flight before an abnormal exit is reported: its event first."""
        if self.saver is None:
            return
        try:
            self.saver.wait()
        except Exception as e:
            print(f"GPU {self.s.gpu_id}: the checkpoint in flight failed: {e}",
                  file=sys.stderr, flush=True)

    def _run_step(self, batches, step: int):
        """One step. The first compiled step is rerun eager from the same state; a compile
        failure or a result outside COMPILE_BAND continues eager, with a `compile` event
        saying why. The run always goes on from the eager result."""
        if not self.trainer.compiled or self.compile_checked:
            return self.trainer(batches, step)
        self.compile_checked = True
        before = self.model.carry_state(), capture_rng(self.device), self.trainer.snapshot()
        t0 = time.perf_counter()
        try:
            compiled = self.trainer(batches, step)
        except torch.OutOfMemoryError:
            raise
        except NonFiniteError as e:
            compiled = e                # judged against the eager step below
        except Exception as e:
            message = str(e).strip().splitlines()[0] if str(e).strip() else ""
            self._rewind(before)
            self._continue_eager("failed", f"{type(e).__name__}: {message}")
            return self.trainer(batches, step)
        seconds = time.perf_counter() - t0
        self.compile_counts = self.trainer.compile_counts()
        self._rewind(before)
        with self.trainer.eager():
            eager = self.trainer(batches, step)    # non-finite here: the run's own NaN
        why = compiled_divergence(compiled, eager)
        if why is not None:
            self._continue_eager("diverged", why, seconds=seconds, **self.compile_counts)
        else:
            self.log.event("compile", status="ok", seconds=seconds, **self.compile_counts)
        return eager

    def _rewind(self, before) -> None:
        carry, rng, snapshot = before
        self.trainer.restore(snapshot)
        self.model.load_carry_state(carry)
        restore_rng(rng, self.device)

    def _continue_eager(self, status: str, reason: str, **fields) -> None:
        self.log.event("compile", status=status, reason=reason[:500], **fields)
        print(f"GPU {self.s.gpu_id}: compile {status}, continuing uncompiled: {reason[:200]}",
              file=sys.stderr, flush=True)
        self.trainer.uncompile()

    def _check_recompiles(self) -> None:
        """A `compile` event `recompiled` when dynamo's counts move after the first step."""
        if not (self.trainer.compiled and self.compile_checked):
            return
        counts = self.trainer.compile_counts()
        if counts == self.compile_counts:
            return
        self.compile_counts = counts
        self.log.event("compile", status="recompiled", step=self.step, **counts)
        print(f"GPU {self.s.gpu_id}: the compiled step compiled again at step {self.step}: "
              f"{counts['recompiles']} recompile(s), {counts['graphs']} graph(s), "
              f"{counts['graph_breaks']} graph break(s)", file=sys.stderr, flush=True)

    def _report(self, result, tok_s: float) -> None:
        self._check_recompiles()
        mem = self._mem_gb()
        self.log.metrics(step=self.step, next_token=self.next_token, tf=result.tf,
                         ema_tf=self.ema_tf, ss=self.last_ss, ema_ss=self.ema_ss, lb=result.lb,
                         grad_norm=result.grad_norm, tok_s=tok_s, mem_gb=mem)
        ss_shown = result.ss  # v1 shows ss only when this step ran an SS pass
        with self.stdout_lock:   # the writer thread prints its "saved" line too
            print(human_line(self.s.gpu_id, self.next_token, result.tf, self.ema_tf, ss_shown,
                             self.ema_ss, result.lb, tok_s, mem), flush=True)

    def _check_merge(self, entry=None, waited_s: float | None = None) -> bool:
        """At a step boundary: adopt the inbox's round if it is newer than the last adopted
        and names this GPU at this token (weights in place; optimizer state, RNG, carried
        state and next token stay this worker's), or refuse its file with one line and go
        on with the weights unchanged. True when adopted."""
        try:
            if entry is None:
                entry = self.merge_inbox.poll()
            if entry is None or entry.round <= self.merge_round \
                    or not entry.adopts(self.s.gpu_id, self.next_token):
                return False
            params = read_merged(entry, self.merge_inbox.pod_dir, self.model)
        except MergeRefused as e:
            self.log.event("merge_refused", round=e.round, reason=e.reason)
            print(f"GPU {self.s.gpu_id}: merge round {e.round} refused, training on with its "
                  f"own weights: {e.reason}", file=sys.stderr, flush=True)
            return False
        adopt(self.model, params)
        self.merge_round = entry.round
        self.log.event("merge_adopted", round=entry.round, at_token=self.next_token,
                       step=self.step, waited_s=waited_s)
        with self.stdout_lock:
            print(f"GPU {self.s.gpu_id}: merge round {entry.round} adopted at "
                  f"next_token={self.next_token} step={self.step}", flush=True)
        return True

    def _boundary(self, before: int, after: int) -> int | None:
        """The round boundary a step from token `before` to `after` reached, if any."""
        every, origin = self.s.merge_every, self.s.merge_origin
        if not every or after <= origin:
            return None
        k = (after - origin) // every
        return k if k >= 1 and k > max(before - origin, 0) // every else None

    def _round_at(self, boundary: int) -> None:
        """Round boundary `boundary`: the checkpoint here is on disk, `merge_wait` says where,
        and the worker waits until the inbox decides this boundary (or a stop): then it
        adopts the round's weights if it is in the quorum and saves them, or trains on."""
        inbox = self.merge_inbox
        try:
            inbox.poll()
        except MergeRefused:
            pass                               # said below, if it still does not parse
        entry, waited = inbox.entry, None
        if entry is None or not entry.decides(boundary, self.s.stage):
            if self.saved_step != self.step or not self.ckpt_out.exists():
                self._save()
            if self.saver is not None:
                self.saver.wait()
            path, digest = self.last_saved or (self.ckpt_out, file_sha256(self.ckpt_out))
            self.log.event("merge_wait", boundary=boundary, next_token=self.next_token,
                           step=self.step, checkpoint=str(path), sha256=digest)
            with self.stdout_lock:
                print(f"GPU {self.s.gpu_id}: at merge round boundary {boundary} "
                      f"(next_token={self.next_token}): waiting for the round", flush=True)
            t0, said = time.perf_counter(), None
            while self.stop.requested is None:
                try:
                    inbox.poll()
                except MergeRefused as e:
                    if e.reason != said:
                        said = e.reason
                        self.log.event("merge_refused", round=e.round, reason=e.reason)
                entry = inbox.entry
                if entry is not None and entry.decides(boundary, self.s.stage):
                    break
                time.sleep(MERGE_POLL_S)
            else:
                return              # stopped while waiting: this boundary's file is the last
            waited = round(time.perf_counter() - t0, 3)
        if self._check_merge(entry, waited):
            self._save()            # the round's weights are this GPU's newest checkpoint
        elif entry.round > self.merge_round:
            reason = "refused" if entry.refused else "left_out"
            self.log.event("merge_skipped", round=entry.round, boundary=boundary,
                           reason=reason, waited_s=waited)

    # --- the loop -------------------------------------------------------------------------
    def _end_reason(self, run_steps: int) -> str | None:
        if self.stop.requested:
            return "signal"
        if self.s.max_steps and run_steps >= self.s.max_steps:
            return "max_steps"
        if self.next_token + self.s.tokens_per_step + 1 > len(self.shard):
            return "end_of_shard"
        return None

    def train(self) -> str:
        s = self.s
        per_step = s.tokens_per_step
        run_steps, window_tokens, window_t0 = 0, 0, time.perf_counter()
        unreported = None   # the newest step's result while no metrics line carries it
        while True:
            reason = self._end_reason(run_steps)
            if reason is not None:
                if unreported is not None:   # the final checkpoint's step gets its line:
                    elapsed = max(time.perf_counter() - window_t0, 1e-9)
                    self._report(unreported, window_tokens / elapsed)
                return reason                # the launcher judges that checkpoint by it
            if self.saver is not None:
                self.saver.check()   # a failed background write stops the run here
            step = self.step + 1
            self.faults.before_step(step)
            if self.merge_inbox is not None and not self.s.merge_every:
                self._check_merge()
            batches = [self._batch(self.next_token + i * s.tokens_per_batch)
                       for i in range(s.accum)]
            result = self._run_step(batches, step)
            self.step, self.next_token = step, self.next_token + per_step
            self.stop.progressed = True      # from here a stop checkpoints first
            run_steps += 1
            window_tokens += per_step
            self.ema_tf = ema(self.ema_tf, result.tf)
            if result.ss is not None:
                self.last_ss, self.ema_ss = result.ss, ema(self.ema_ss, result.ss)
            self.last_lb = result.lb
            unreported = result
            if run_steps == 1 and self.saver is not None and s.save_every:
                # the optimizer state exists now: its buffers are allocated off this thread
                self.saver.prepare(self._payload())
            if run_steps == 1 or step % s.log_every == 0:
                now = time.perf_counter()
                self._report(result, window_tokens / max(now - window_t0, 1e-9))
                window_tokens, window_t0, unreported = 0, now, None
            if s.save_every and step % s.save_every == 0:
                self._save()
            boundary = self._boundary(self.next_token - per_step, self.next_token)
            if boundary is not None:
                self._round_at(boundary)

    def run(self) -> int:
        s = self.s
        tensorboard = TensorBoardScalars(s.tb_dir, s.stage) if s.tb_dir else None
        self.log = MetricsWriter(s.metrics, s.gpu_id, tensorboard)
        self.stop.install()
        self.compile_checked = False
        self.compile_counts = None   # torch's counts after the first compiled step
        self.last_ss = None  # the SS value of the latest SS pass in this run
        self.last_lb = None
        self.stdout_lock = threading.Lock()
        self.saver = None if not s.async_save else AsyncCheckpointer(
            self.ckpt_out, s.save_keep, self.device, on_durable=self._on_durable,
            on_write=lambda numbers: self.faults.save_write_hook(numbers["step"]))
        remove_stale_temps(self.ckpt_out)
        self.log.event("start", pid=os.getpid(), next_token=self.next_token, step=self.step,
                       resume=self.start.kind, source=self.start.source,
                       device=str(self.device), settings=s.to_dict())
        print(f"GPU {s.gpu_id}: start {self.start.kind} next_token={self.next_token} "
              f"step={self.step} B={s.batch} SEQ={s.seq} ACCUM={s.accum} device={self.device}",
              flush=True)
        for message in self.start.warnings:
            print(f"GPU {s.gpu_id}: warning: {message}", file=sys.stderr, flush=True)
            self.log.event("warning", message=message)
        if self.stored_batch is not None and self.stored_batch != s.batch:
            self.log.event("batch_change", old=self.stored_batch, new=s.batch,
                           message="carried state reset to zeros")
        try:
            if self.merge_inbox is not None:
                self._check_merge()     # a round taken while this GPU was down: before step 1
                boundary = self._boundary(self.next_token - s.tokens_per_step, self.next_token)
                if boundary is not None and self.start.kind == "full":
                    self._round_at(boundary)    # restarted at a boundary its round decides
            if s.compile:
                self.trainer.compile()
            reason = self.train()
            if self.saver is not None:
                self.saver.wait()   # the save in flight lands before the final one is decided
            if self.saved_step != self.step or not self.ckpt_out.exists():
                self._save()
            if self.saver is not None:
                self.saver.wait()   # SIGTERM or the end: the final checkpoint is durable first
        except (NonFiniteError, NonFiniteCheckpointError) as e:
            self._settle_saves()
            values = getattr(e, "values", {})
            self.log.event("nan", step=getattr(e, "step", self.step + 1), values=values,
                           message=str(e))
            print(f"GPU {s.gpu_id}: {e}; stopping without a checkpoint", file=sys.stderr)
            return WorkerExitCode.NAN
        except torch.OutOfMemoryError as e:
            self._settle_saves()
            self.log.event("oom", step=self.step + 1, message=str(e)[:500])
            print(f"GPU {s.gpu_id}: out of memory at step {self.step + 1}: {e}", file=sys.stderr)
            return WorkerExitCode.OOM
        except StoppedBeforeProgress as e:
            self.log.event("done", reason="signal_before_first_step", signal=str(e),
                           step=self.step, next_token=self.next_token)
            print(f"GPU {s.gpu_id}: stopped ({e}) before its first step: nothing to save, "
                  f"it resumes from next_token={self.next_token}", flush=True)
            self.log.close()
            return WorkerExitCode.OK
        except ShardError as e:
            self._settle_saves()
            self.log.event("error", message=str(e), exit_code=WorkerExitCode.SETTINGS)
            print(f"error: {e}", file=sys.stderr)
            return WorkerExitCode.SETTINGS
        except Exception as e:
            self._settle_saves()
            full = no_space_error(e)
            if full is not None:
                return self._disk_full(full)
            self.log.event("error", message=f"{type(e).__name__}: {e}"[:2000], exit_code=WorkerExitCode.CRASH)
            traceback.print_exc()
            return WorkerExitCode.CRASH
        finally:
            try:
                sys.stdout.flush()
            except OSError:      # the log's disk is full: the exit code still says why
                pass
        self.log.event("done", reason=reason, step=self.step, next_token=self.next_token,
                       phase=s.phase,
                       ema_tf=self.ema_tf, ema_ss=self.ema_ss)
        print(f"GPU {s.gpu_id}: DONE ({reason}) next_token={self.next_token}", flush=True)
        self.log.close()
        return WorkerExitCode.OK

    def _disk_full(self, exc: OSError) -> int:
        """Disk full: one line, as an event too if the metrics file can take it."""
        message = describe_disk_full(self.ckpt_out, exc)
        try:
            self.log.event("error", message=message, exit_code=WorkerExitCode.DISK_FULL)
        except OSError:
            pass
        try:
            print(f"error: GPU {self.s.gpu_id}: {message}", file=sys.stderr, flush=True)
        except OSError:       # its log is on the full disk too
            pass
        return WorkerExitCode.DISK_FULL


def main(environ=None) -> int:
    environ = os.environ if environ is None else environ
    worker = None
    try:
        worker = Worker(WorkerSettings.from_env(environ))
        worker.stop.install()       # a stop while the model loads ends the worker cleanly
        worker.setup()
        return worker.run()
    except StoppedBeforeProgress as e:
        print(f"stopped ({e}) before its first step: nothing to save", flush=True)
        return WorkerExitCode.OK
    except (SettingsError, ShardError) as e:
        print(f"error: {e}", file=sys.stderr)
        return WorkerExitCode.SETTINGS
    except torch.OutOfMemoryError as e:  # building or loading the model did not fit
        print(f"error: out of memory during setup: {str(e).splitlines()[0]}", file=sys.stderr)
        return WorkerExitCode.OOM
    finally:
        if hasattr(worker, "log"):   # every exit path: the TensorBoard writer flushes its queue
            worker.log.close()


if __name__ == "__main__":
    sys.exit(main())
