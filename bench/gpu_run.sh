#!/usr/bin/env bash
# The command a GPU session runs, in two forms. The routine: --quick first, commit what it wrote, then -- with time
# left -- the full run (or the quick case's fast rows: QUICK_PARTS=bench BENCH_ARGS="--quick-modes fast").
#   OUT=/abs/dir bash bench/gpu_run.sh --quick   # <= 4 min on one H200 (machine start excluded): estimate below
#   OUT=/abs/dir bash bench/gpu_run.sh           # the full run: ~9.5 min on one H100/H200 with ~128 GB of host RAM
#   BENCH_ARGS=--smoke ADAMW_ARGS="--smoke --unit 1e5" bash bench/gpu_run.sh --quick   # dry run, any machine
#   BENCH_ARGS="--smoke --profile" ADAMW_ARGS=--smoke bash bench/gpu_run.sh             # the full one's (< 1 min)
# --quick (240 s in all; QUICK_PARTS picks among "tests adamw bench"):
#   tests  tests/engine/test_gpu.py's exactness subset: async == synchronised bit for bit, fp32 == the reference (75 s cap)
#   adamw  the host AdamW under both copy engines: bench/adamw_cpu.py --dma-only, 2 units of 7B width (40 s cap)
#   bench  bench/gpu.py --quick in what is left: the pinned peaks, then the wide case (24 layers of 7B width, 2 of
#          26 units resident) at 16,384 and 12,288 tokens, clip 1 and 0, lean then fast, the plan's GPU-updated
#          units and none -- a trainer per (mode, clip, units), each row's steady and per-step-synced step beside
#          the planner's (results.md); a trainer whose planned cost no longer fits the budget is listed, skipped.
#   Estimated on an H200 from the measured runs' costs (bench/NOTES.md, 2026-11-28): tests ~38 s, adamw ~12 s,
#   bench start + pinned ~8 s; a streamed trainer ~25 s (build, first touch, free) + 8 steps (13-24 s): the four
#   lean trainers (8 rows) in ~163 s, ~225 s in all; the four fast ones (~170 s more) are listed, skipped.
# The full run: the GPU tests, the host AdamW on buffers far beyond the L3 (bench/adamw_cpu.py), the single-GPU
# benchmark (the headline), the host's issue cost fitted on this GPU, then -- with 2 or more GPUs and time left --
# the multi-GPU case. Logs and results in $OUT.
# Installs nothing (the GPU box has no network): torch with CUDA, pytest and transformers must be importable.
# Every part runs even when an earlier one failed; the exit status is non-zero if any failed. Timeouts keep the
# whole under the 10-minute limit of one device command (570 s): the tests get 150 s, the host AdamW 90 s, the bench
# what they left (less 60 s kept for the calibration), the multi-GPU case what remains. The bench's default here: the
# wide case at 24 layers (the depth of the first measured run, bench/results/2026-11-27-nvidia-h200) in the streaming
# regime (<= 10% of the units resident) at 16k and 32k tokens (64k and 128k were measured by the second run:
# --wide-sweep 2,4,8 adds them), clipped -- lean and fast with the plan's units updated on the GPU, fast with every
# update on the host --, lean unclipped, and as the planner chooses (all resident), clip 0 and 1; no trace and no
# FSDP2 peer (19.5 s a step: ~2.5 minutes): BENCH_ARGS="--profile --peers resident,fsdp2_offload --only
# pinned,peers,wide" adds them. Each part writes into a directory of its
# own under $OUT, made fresh (a rerun with the same $OUT replaces its results), and writes after every case, so a
# timeout still leaves what was measured.
# To commit: copy "$OUT/bench" (--quick: "$OUT/quick"), "$OUT/host_op.json", "$OUT/adamw_cpu.json", "$OUT/test_gpu.log"
# (and "$OUT/multi/multi_gpu.json") to bench/results/<date>-<device>[-quick]/ (trace.json.gz is large: keep it out).
set -u
case "${1:-}" in
  -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
  ""|--quick) ;;
  *) echo "error: bench/gpu_run.sh takes --quick or nothing (the full run), got $1; see --help" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
OUT="${OUT:-out-gpu}"
mkdir -p "$OUT"
rm -rf "$OUT/bench" "$OUT/quick" "$OUT/multi" "$OUT/host_op.json" "$OUT/adamw_cpu.json"
{ date -Is; nvidia-smi || true; free -g; nproc; git log -1 --oneline 2>/dev/null || true
  python -c "import torch
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available())
try:
    import pytest, transformers  # noqa: F401
except ImportError as e:
    print('note:', e, '(pip install -r requirements-dev.txt)')" 2>&1
} 2>&1 | tee "$OUT/env.log"

if [ "${1:-}" = "--quick" ]; then
  LIMIT=240                                                 # seconds, from the script's start
  PARTS="${QUICK_PARTS:-tests adamw bench}"
  tests=0 adamw=0 bench=0
  if [[ " $PARTS " == *" tests "* ]]; then
    timeout 75 python -m pytest -q tests/engine/test_gpu.py -s -k "async_equals_synchronised or fp32_equals_reference" \
      2>&1 | tee "$OUT/test_gpu.log"
    tests=${PIPESTATUS[0]}                                  # (5: none selected -- a renamed test; fails)
    echo "tests/engine/test_gpu.py (exactness) exit status: $tests" | tee -a "$OUT/test_gpu.log"
  fi
  if [[ " $PARTS " == *" adamw "* ]]; then
    # shellcheck disable=SC2086  # ADAMW_ARGS, BENCH_ARGS: lists of flags
    timeout 40 python bench/adamw_cpu.py --dma-only ${ADAMW_ARGS:---params 4.05e8 --unit 202383360 --rounds 2} \
      --json "$OUT/adamw_cpu.json" 2>&1 | tee "$OUT/adamw_cpu.log"
    adamw=${PIPESTATUS[0]}
    echo "bench/adamw_cpu.py --dma-only exit status: $adamw" | tee -a "$OUT/adamw_cpu.log"
  fi
  if [[ " $PARTS " == *" bench "* ]]; then
    # shellcheck disable=SC2086
    timeout $((LIMIT - SECONDS)) python bench/gpu.py --quick --budget-s $((LIMIT - 15 - SECONDS)) \
      --out "$OUT/quick" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/quick.log"
    bench=${PIPESTATUS[0]}
    echo "bench/gpu.py --quick exit status: $bench ($SECONDS s since the start)" | tee -a "$OUT/quick.log"
  fi
  [ "$tests" -eq 0 ] && [ "$adamw" -eq 0 ] && [ "$bench" -eq 0 ]
  exit
fi

timeout 150 python -m pytest -q tests/engine/test_gpu.py -s 2>&1 | tee "$OUT/test_gpu.log"
tests=${PIPESTATUS[0]}
echo "tests/engine/test_gpu.py exit status: $tests" | tee -a "$OUT/test_gpu.log"

ADAMW_ARGS="${ADAMW_ARGS:---params 8e8 --unit 202383360}"   # 4 Llama-2-7B-width layers: ~40 GB of host RAM
# shellcheck disable=SC2086  # ADAMW_ARGS, BENCH_ARGS: lists of flags
timeout 90 python bench/adamw_cpu.py $ADAMW_ARGS --json "$OUT/adamw_cpu.json" 2>&1 | tee "$OUT/adamw_cpu.log"
adamw=${PIPESTATUS[0]}
echo "bench/adamw_cpu.py exit status: $adamw" | tee -a "$OUT/adamw_cpu.log"

# shellcheck disable=SC2086
timeout $((510 - SECONDS)) python bench/gpu.py --out "$OUT/bench" \
  ${BENCH_ARGS:---only pinned,peers,wide --wide-layers 24 --wide-sweep 2 --peers resident,resident_no_ckpt} 2>&1 \
  | tee "$OUT/bench.log"
bench=${PIPESTATUS[0]}
echo "bench exit status: $bench" | tee -a "$OUT/bench.log"

device=cpu
python -c "import torch; assert torch.cuda.is_available()" 2>/dev/null && device=cuda
timeout $((570 - SECONDS)) python bench/host_overhead.py --calibrate --rounds 2 --device "$device" \
  --json "$OUT/host_op.json" 2>&1 | tee "$OUT/host_op.log"
calib=${PIPESTATUS[0]}
echo "host_overhead --calibrate exit status: $calib" | tee -a "$OUT/host_op.log"

multi=0
ngpu=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$ngpu" -gt 1 ] && [ $((570 - SECONDS)) -gt 60 ]; then
  timeout $((570 - SECONDS)) python bench/multi_gpu.py --out "$OUT/multi" 2>&1 | tee "$OUT/multi.log"
  multi=${PIPESTATUS[0]}
  echo "bench/multi_gpu.py ($ngpu GPUs) exit status: $multi" | tee -a "$OUT/multi.log"
fi
[ "$tests" -eq 0 ] && [ "$adamw" -eq 0 ] && [ "$bench" -eq 0 ] && [ "$calib" -eq 0 ] && [ "$multi" -eq 0 ]
