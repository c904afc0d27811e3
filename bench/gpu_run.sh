#!/usr/bin/env bash
# The one command a GPU session runs: the GPU tests, the host AdamW on buffers far beyond the L3 (bench/adamw_cpu.py),
# the single-GPU benchmark (the headline), the host's issue cost fitted on this GPU, then -- with 2 or more GPUs and
# time left -- the multi-GPU case. Logs and results in $OUT.
#   OUT=/abs/dir bash bench/gpu_run.sh     # ~6-9 min on one H100/H200 with ~128 GB of host RAM
#   BENCH_ARGS="--smoke --profile" ADAMW_ARGS=--smoke bash bench/gpu_run.sh   # dry run on any machine (< 1 min)
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
# To commit: copy "$OUT/bench", "$OUT/host_op.json", "$OUT/adamw_cpu.json" (and "$OUT/multi/multi_gpu.json") to
# bench/results/<date>-<device>/ (trace.json.gz is large: keep it out of git).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-out-gpu}"
mkdir -p "$OUT"
rm -rf "$OUT/bench" "$OUT/multi" "$OUT/host_op.json" "$OUT/adamw_cpu.json"
{ date -Is; nvidia-smi || true; free -g; nproc; git log -1 --oneline 2>/dev/null || true
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available())"
  python -c "import pytest, transformers" 2>&1 || echo "note: pytest/transformers missing (pip install -r requirements-dev.txt)"
} 2>&1 | tee "$OUT/env.log"

timeout 150 python -m pytest -q tests/test_gpu.py -s 2>&1 | tee "$OUT/test_gpu.log"
tests=${PIPESTATUS[0]}
echo "tests/test_gpu.py exit status: $tests" | tee -a "$OUT/test_gpu.log"

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
