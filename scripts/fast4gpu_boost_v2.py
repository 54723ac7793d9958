#!/usr/bin/env python3
"""Fractus trainer v2: one process per GPU. A thin entry; the worker is fractus/train/worker.py.

    CUDA_VISIBLE_DEVICES=$i GPU_ID=$i START_TOKEN=<from manifest> BATCH=8 CE_CHUNK=2048 \
        FRACTUS_ATTN_IMPL=chunked COMPILE=1 python -u scripts/fast4gpu_boost_v2.py

Every variable, its default and meaning: docs/WORKER.md (source: fractus/train/env.py).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from fractus.train.worker import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
