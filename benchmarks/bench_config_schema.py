"""What a pydantic v2 schema of the person-written files would cost at start-up, against the
hand-written one: each side timed in a fresh interpreter (min of --runs).

`pydantic` side: importing pydantic and building the models of fractus-pod.yaml (every
section), stages.yaml, trusted_loss.yaml (checks, supervision, peers, canary, probe) and a
manifest entry with extra="forbid", ranges, literals and a duration type; no error
formatter and no template/env/URL checks, so it is the cost's lower bound. `hand-written`
side: importing the modules that parse the same files today. Every command that reads a
pod's config (status, launch, sync, ...) would pay the difference.

    python benchmarks/bench_config_schema.py [--runs 7]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

HAND_WRITTEN = ("import launcher.config.podconfig, launcher.config.stages, "
                "launcher.checks.trusted_loss, launcher.pod.manifest_entry")


def pydantic_schema():
    """The models (built when called: importing this module imports no pydantic)."""
    import re
    from typing import Annotated, Literal, Union
    from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

    _UNITS = {"s": 1, "m": 60, "h": 3600}
    def _dur(v):
        if isinstance(v, str) and v[:-1] and v[-1] in _UNITS:
            return float(v[:-1]) * _UNITS[v[-1]]
        return v
    Duration = Annotated[float, BeforeValidator(_dur)]

    class Strict(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    class Webhook(Strict):
        format: Literal["generic", "ntfy", "slack", "discord"]
        url_env: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")

    class Alerts(Strict):
        webhooks: tuple[Webhook, ...] = Field(min_length=1)
        min_severity: Literal["info", "warning", "critical"] = "warning"
        hub_failures: int = Field(3, ge=1, le=1000)
        repeat_after_s: float = Field(3600.0, ge=0, le=7 * 86400)
        per_minute: int = Field(6, ge=1, le=600)

    class Tracker(Strict):
        kind: Literal["trackio"]
        project: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")

    class Retention(Strict):
        keep: int = Field(ge=1, le=1000)
        milestones: bool = True
        pins: tuple[str, ...] = ()
        budget: int | str | None = None

    class Data(Strict):
        url: str
        revision: str = Field(pattern=r"^[0-9a-f]+$")

    class Ray(Strict):
        address: str | None = None
        workdir: str = "{pod}/nodes/{node}"
        resource: str | None = None
        fence_s: float = Field(60.0, ge=5, le=3600)

    class Sync(Strict):
        interval: Duration = Field(3600.0, ge=1, le=30 * 86400)
        merge: bool = False
        attempts: int = Field(5, ge=1, le=100)
        backoff_s: Duration = Field(1.0, ge=0, le=30 * 86400)
        commits_per_hour: int = Field(128, ge=1, le=36000)

    class DemoData(Strict):
        tokens: int = Field(ge=1, le=10**9)
        vocab: int = Field(ge=2, le=1 << 20)
        seed: int = Field(ge=0, le=2**32 - 1)

    class PhaseItem(Strict):
        shard: str
        name: str = Field("", min_length=1, max_length=64)

    class PodConfig(Strict):
        model: str = "1b"
        devices: str = "auto"
        shards: Union[str, list[Union[str, PhaseItem]]] = "data/shard_phase2_gpu{i}.npy"
        checkpoints: str = "checkpoints/fractus_1b_gpu{i}.pt"
        manifest: str = "checkpoints/RESUME_MANIFEST_8GPU.json"
        stages: str = "manifests/stages.yaml"
        criteria: str = "manifests/trusted_loss.yaml"
        worker: list[str] = ["python", "-u", "-m", "fractus.train.worker"]
        env: dict[str, Union[str, int, float]] = {}
        pass_env: list[str] = []
        save_every: int = Field(800, ge=0, le=10**9)
        save_keep: int = Field(3, ge=1, le=1000)
        log_every: int = Field(40, ge=1, le=10**9)
        poll_interval_s: float = Field(1.0, ge=0.05, le=3600)
        stop_grace_s: float = Field(120.0, ge=0, le=86400)
        hub: str | None = None
        sync: Sync = Sync()
        retention: Retention | None = None
        demo_data: DemoData | None = None
        ray: Ray | None = None
        data: Data | None = None
        alerts: Alerts | None = None
        tracker: Tracker | None = None
        disk_low_gib: float = Field(20.0, ge=0, le=10**9)
        price_per_gpu_hour: float | None = Field(None, ge=0, le=10**6)

        @field_validator("checkpoints")
        @classmethod
        def _tmpl(cls, v):
            if "{i}" not in v:
                raise ValueError("must contain {i}")
            return v

    class StageSpec(Strict):
        name: str | None = None
        exact: bool = False
        window: int = Field(0, ge=0)
        settings: dict[str, Union[str, int, float, bool]] = {}

    class Stages(Strict):
        stages: dict[int, StageSpec]

    NonNeg = Annotated[float, Field(ge=0, allow_inf_nan=False)]
    NonNegInt = Annotated[int, Field(ge=0)]
    class Check(Strict):
        interval: NonNegInt
        initialDelay: NonNegInt
        failureLimit: NonNegInt
    class Finite(Check): pass
    class Continuity(Check):
        maxAbsDelta: NonNeg
    class Trend(Check):
        lookback: NonNegInt
        tolerance: NonNeg
    class LbBand(Check):
        band: NonNeg | None
        relativeBand: NonNeg | None
    class SsRatio(Check):
        maxRatio: NonNeg
    class LossSpike(Check):
        windowLogs: NonNegInt
        factor: NonNeg
        patience: NonNegInt
    class Checks(Strict):
        finite: Finite; continuity: Continuity; trend: Trend; lb_band: LbBand; ss_ratio: SsRatio; loss_spike: LossSpike
    class Restarts(Strict):
        max_restarts: NonNegInt; window_s: NonNeg; backoff_s: NonNeg; backoff_max_s: NonNeg
    class Hang(Strict):
        timeout_s: NonNeg; startup_timeout_s: NonNeg
    class Supervision(Strict):
        restarts: Restarts; hang: Hang
    class Peers(Strict):
        fraction: float = Field(gt=0, le=1); windowLines: int = Field(ge=1); k: NonNeg; minDeviation: NonNeg; minGpus: int = Field(ge=3)
        action: Literal["alert", "rollback"]
    class Tol(Strict):
        rtol: NonNeg; atol: NonNeg
    class Approx(Strict):
        maxEmaTfRise: NonNeg
    class Canary(Strict):
        steps: int = Field(ge=2); timeout_s: NonNeg; exact: dict[Literal["cpu", "cuda"], Tol]; approximate: Approx
    class Probe(Strict):
        k: NonNeg; band: NonNeg; relativeBand: NonNeg | None; offManifoldAcc: NonNeg; rows: int = Field(ge=2); every: NonNegInt; parallel: int = Field(ge=1); timeout_s: NonNeg
    class CriteriaFile(Strict):
        checks: Checks; supervision: Supervision; peers: Peers; canary: Canary; probe: Probe
    class ManifestEntry(Strict):
        gpu: int = Field(ge=0, le=1023); stage: int = Field(ge=1); phase: int = Field(1, ge=1); step: int = Field(ge=0); checkpoint: str; sha256: str = Field(pattern="^[0-9a-f]{64}$"); ema_tf: float | None = None
    return CriteriaFile, PodConfig, Stages, ManifestEntry


def timed(code: str) -> float:
    """Milliseconds `code` takes in a fresh interpreter (after its own start-up)."""
    probe = f"import time; t = time.perf_counter(); {code}; print(time.perf_counter() - t)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                          text=True, check=True)
    return 1000 * float(done.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    runs = parser.parse_args().runs
    sides = {"hand-written": HAND_WRITTEN,
             "pydantic": "import pydantic; from benchmarks.bench_config_schema import "
                         "pydantic_schema; pydantic_schema()",
             "pydantic import only": "from pydantic import BaseModel"}
    for name, code in sides.items():
        times = sorted(timed(code) for _ in range(runs))
        print(f"{name:22s} min {times[0]:6.1f} ms  median {times[len(times) // 2]:6.1f} ms")


if __name__ == "__main__":
    main()
