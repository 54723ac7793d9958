#!/usr/bin/env bash
# The one prepared device check (run it when a session has a GPU; about 5-8 minutes):
#   equivalence tests on CUDA (the tests enable their CUDA cases when a GPU is visible;
#   test_async_save.py: the pinned snapshot of a GPU that trains on),
#   the attention benchmark in bf16 at the 1B shapes, and the
#   canary's bf16 band. Everything lands under $OUT (default: ./gpu-results).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
pip install -q -e '.[test]' >"$OUT/pip.log" 2>&1 || true
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true
python -c "import torch; print(torch.__version__, torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" >"$OUT/torch.txt" 2>&1

timeout 240 python -m pytest -q tests/test_attention_kernels.py tests/test_ce.py \
    tests/test_engine_fixtures.py tests/test_engine.py tests/test_async_save.py \
    >"$OUT/equivalence_tests.txt" 2>&1
echo "equivalence tests rc=$?" >>"$OUT/summary.txt"

timeout 180 python benchmarks/bench_attention.py --device cuda --dtype bfloat16 --repeats 10 \
    --json "$OUT/bench_attention_cuda_bf16.json" >"$OUT/bench_attention_cuda_bf16.md" 2>&1
echo "bench_attention rc=$?" >>"$OUT/summary.txt"

timeout 120 python benchmarks/bench_canary.py --device cuda --band --model small \
    >"$OUT/canary_band.txt" 2>&1
echo "canary band rc=$?" >>"$OUT/summary.txt"
cat "$OUT/summary.txt"
