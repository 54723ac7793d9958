"""Engine configuration: the reference constructor keywords, and named presets.

`EngineConfig`'s fields are exactly the reference `ContinuousThoughtEngine(**config)`
keywords, so a legacy checkpoint's `config` (minus trainer extras) builds it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EngineConfig:
    vocab_size: int = 50257
    d_model: int = 256
    n_layers: int = 1
    n_heads: int = 4
    d_head: int = 64
    n_levels: int = 2
    n_oscillators: int = 16
    coupling_rank: int = 8
    n_experts: int = 8
    top_k: int = 2
    expert_d_ff: int = 256
    siren_rank: int = 32  # 0 means dense experts

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{f.name} must be an int, got {value!r}")
            minimum = 0 if f.name == "siren_rank" else 1
            if value < minimum:
                raise ValueError(f"{f.name} must be >= {minimum}, got {value}")
        if self.d_model != self.n_heads * self.d_head:
            raise ValueError(
                f"d_model must equal n_heads * d_head ({self.n_heads} * {self.d_head}), "
                f"got {self.d_model}")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k must be in [1, n_experts={self.n_experts}], got {self.top_k}")

    @classmethod
    def from_dict(cls, d: dict) -> "EngineConfig":
        """Build from a checkpoint's `config`, ignoring trainer extras (gpu, batch, lr, ...)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: int(v) for k, v in d.items() if k in names})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


PRESETS: dict[str, EngineConfig] = {
    # The production Fractus-1B run.
    "1b": EngineConfig(vocab_size=50257, d_model=1280, n_layers=16, n_heads=20, d_head=64,
                       n_levels=2, n_oscillators=16, coupling_rank=8, n_experts=128, top_k=2,
                       expert_d_ff=2048, siren_rank=64),
    # The user's CPU benchmark shape (d=128, 2 blocks, 8 experts, GPT-2 vocabulary).
    "small": EngineConfig(vocab_size=50257, d_model=128, n_layers=2, n_heads=2, d_head=64,
                          n_levels=2, n_oscillators=16, coupling_rank=8, n_experts=8, top_k=2,
                          expert_d_ff=256, siren_rank=32),
    # Tests and the CPU demo pod: trains in seconds on synthetic shards (vocab 512).
    "tiny": EngineConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=2, d_head=32,
                         n_levels=2, n_oscillators=8, coupling_rank=4, n_experts=8, top_k=2,
                         expert_d_ff=64, siren_rank=16),
}


def load_model_config(spec: str) -> EngineConfig:
    """A preset name, or a .json/.yaml file of constructor keywords."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if path.suffix in (".json", ".yaml", ".yml") and path.is_file():
        text = path.read_text()
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml  # only for a .yaml config: the engine itself needs no yaml
            data = yaml.safe_load(text)
        if not isinstance(data, dict):
            raise ValueError(f"{spec}: expected a mapping of constructor keywords")
        unknown = set(data) - {f.name for f in dataclasses.fields(EngineConfig)}
        if unknown:
            raise ValueError(f"{spec}: unknown keys {sorted(unknown)}")
        return EngineConfig(**data)
    raise ValueError(
        f"unknown model {spec!r}: expected one of {sorted(PRESETS)} or a .json/.yaml file")
