#!/usr/bin/env bash
# The one command a GPU session runs (issue 6): the GPU tests, then the benchmark; logs and results in $OUT.
#   OUT=/abs/dir bash bench/gpu_run.sh     # ~6-9 min on one H100/H200 with ~128 GB of host RAM
#   BENCH_ARGS="--smoke --profile" bash bench/gpu_run.sh   # dry run of this script on any machine (< 1 min)
# Installs nothing (the GPU box has no network): torch with CUDA, pytest and transformers must be importable.
# The bench runs even when the tests fail; the exit status is non-zero if either failed. Timeouts keep the whole
# under the 10-minute limit of one device command (the bench gets what the tests left of 570 s); the bench
# writes its results after every case, so a timeout still leaves what was measured.
# With 2 or more GPUs it first runs bench/multi_gpu.py (torchrun: N GPUs against one, same losses? tokens/s?)
# into $OUT/multi/multi_gpu.json, in at most 180 s taken from the bench's share.
# To commit: copy "$OUT/bench" (and "$OUT/multi/multi_gpu.json") to bench/results/<date>-<device>/ (trace.json.gz
# is large: keep it out of git).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-out-gpu}"
mkdir -p "$OUT"
{ date -Is; nvidia-smi || true; free -g; nproc; git log -1 --oneline 2>/dev/null || true
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available())"
  python -c "import pytest, transformers" 2>&1 || echo "note: pytest/transformers missing (pip install -r requirements-dev.txt)"
} 2>&1 | tee "$OUT/env.log"

timeout 150 python -m pytest -q tests/test_gpu.py -s 2>&1 | tee "$OUT/test_gpu.log"
tests=${PIPESTATUS[0]}
echo "tests/test_gpu.py exit status: $tests" | tee -a "$OUT/test_gpu.log"

multi=0
ngpu=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$ngpu" -gt 1 ]; then
  timeout 180 python bench/multi_gpu.py --out "$OUT/multi" 2>&1 | tee "$OUT/multi.log"
  multi=${PIPESTATUS[0]}
  echo "bench/multi_gpu.py ($ngpu GPUs) exit status: $multi" | tee -a "$OUT/multi.log"
fi

# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
timeout $((570 - SECONDS)) python bench/gpu.py --out "$OUT/bench" ${BENCH_ARGS:---profile} 2>&1 | tee "$OUT/bench.log"
bench=${PIPESTATUS[0]}
echo "bench exit status: $bench" | tee -a "$OUT/bench.log"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ] && [ "$multi" -eq 0 ]
