#!/usr/bin/env bash
# The next device run in one call, in priority order, each step within the time left, every log
# in one archive ($OUT/run.tgz: a call returns at most 8 files) and the summaries on stdout.
# Before the call, on this machine:
#   bash tools/prepare_device_carry.sh
#   bash tools/patch_overlay.sh ab_pdl bench/experiments/fwd_list_builder_pdl.patch
#   bash tools/patch_overlay.sh ab_lsc bench/experiments/bwd_long_sequence_clear.patch
# The call (carry .cutlass .deps): BUDGET=570 bash bench/experiments/next_device_run.sh
# Steps: 1 (H200 only) issue 3 / 4 re-time: the forward and backward grids at hdims 64 / 128 / 256;
# 2 the list builder's programmatic launch (ab_pdl) against main, tests under both list settings;
# 3 the decode's split sweep and kernel times, and the list's auto order against entries (main's build of step 2);
# 4 the backward's long-sequence clear alone (ab_lsc) against main.
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/gpu_check_out}
mkdir -p "$OUT"
RUN=/tmp/next_run
rm -rf "$RUN" && mkdir -p "$RUN"
start=$(date +%s)
left() { echo $(( ${BUDGET:-570} - ($(date +%s) - start) )); }
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "gpu: $gpu" | tee "$RUN/gpu.txt"
pack() { tar czf "$OUT/run.tgz" -C /tmp next_run; }
trap pack EXIT

if [[ $gpu == *H200* ]]; then
  echo "== 1 grid ($(left) s left)"
  OUT=$RUN/grid KERNEL_SET=custom HDIMS="64;128;256" \
    CMAKE_EXTRA='-DCUFLASH_BUILD_TESTS=OFF -DCUFLASH_KERNEL_REGEX=^flash_(fwd|bwd)_hdim(64|128|256)_bf16_sm90$' \
    STEPS=build,bench,bench_bwd timeout $(( $(left) - 240 )) bash tools/gpu_check.sh >/dev/null 2>&1
  cat "$RUN/grid/summary.txt"
fi

if [[ -d ab_pdl ]] && (( $(left) > 200 )); then
  echo "== 2 pdl ($(left) s left)"
  export TEST_ENV_B='CUFLASH_FWD_ROW_BLOCK_LIST=always'
  export GTEST_FILTER_B='*GpuForward*row_list*:*GpuForward*arlen*:*GpuForward*ack*:*GpuForward*plit*'
  OUT=$RUN/pdl VARIANTS="base pdl@ab_pdl" HDIMS=128 FEATURES="split;packgqa" \
    REGEX='^flash_(fwd|bwd)_hdim128_bf16(_split)?(_packgqa)?_sm90$' TEST_VARIANT=pdl GTEST_FILTER="$GTEST_FILTER_B" \
    BENCH=varlen BENCH_ARGS='--hdims 128 --directions fwd --layouts uniform:2:1024,uniform:4:512,uniform:16:4096' \
    BENCH_ENV_B='CUFLASH_FWD_ROW_BLOCK_LIST=always' PASSES=2 STAGGER=10 timeout $(( $(left) - 60 )) bash tools/gpu_ab.sh
  unset TEST_ENV_B GTEST_FILTER_B
  cp /tmp/ab_tests/summary.txt "$RUN/pdl/tests_summary.txt" 2>/dev/null
  grep -h "^tests" /tmp/ab_tests/summary.txt
  # The Python varlen, split and graph-capture tests on the patch, every list call walked.
  OUT=$RUN/pdl_py BUILD_DIR=/tmp/ab_build_pdl_overlay STEPS=pytest JIT_MODULES=0 PYTEST_K='varlen or split or graph' \
    CUFLASH_FWD_ROW_BLOCK_LIST=always timeout 150 bash /tmp/ab_tree_pdl/tools/gpu_check.sh >/dev/null 2>&1
  grep -h "^pytest" "$RUN/pdl_py/summary.txt"
  for v in base:/tmp/ab_build_base:. pdl:/tmp/ab_build_pdl_overlay:/tmp/ab_tree_pdl; do
    IFS=: read -r name build tree <<<"$v"
    (( $(left) > 60 )) || break
    OUT=$RUN/pdl_gqa_$name BUILD_DIR=$build STEPS=bench_gqa \
      BENCH_GQA_ARGS='--packed --batch 4 --groups 32:4 --seqlens-q 1,16 --kernel-times' \
      BENCH_GQA_ENV_B='CUFLASH_FWD_ROW_BLOCK_LIST=always' timeout 90 bash "$tree/tools/gpu_check.sh" >/dev/null 2>&1
  done
fi

if [[ -d /tmp/ab_build_base ]] && (( $(left) > 60 )); then
  echo "== 3 decode sweep ($(left) s left)"
  OUT=$RUN/sweep BUILD_DIR=/tmp/ab_build_base STEPS=bench_gqa \
    BENCH_GQA_ARGS='--packed --batch 4 --groups 32:4,64:8 --seqlens-q 1,16 --splits 4,8,12,16,24,32 --kernel-times' \
    BENCH_GQA_ARGS_B='--batch 8 --groups 32:8 --seqlens-q 1 --splits 8,16,24,32 --kernel-times' \
    timeout $(( $(left) - 10 )) bash tools/gpu_check.sh >/dev/null 2>&1
  cat "$RUN/sweep/summary.txt" 2>/dev/null
  # The list's order under auto (heads past 16 MB of K / V per sequence, non-causal) against
  # entries, on main's build.
  OUT=$RUN/order BUILD_DIR=/tmp/ab_build_base STEPS=bench_varlen \
    BENCH_VARLEN_ARGS='--hdims 128 --directions fwd --layouts uniform:16:4096,uniform:2:8192,uniform:64:1024' \
    BENCH_VARLEN_ENV_B='CUFLASH_FWD_ROW_BLOCK_LIST_ORDER=entries' timeout 120 bash tools/gpu_check.sh >/dev/null 2>&1
  cat "$RUN/order/summary.txt" 2>/dev/null
  # The no-hint list rule at a larger decode batch (the list where the rectangle of 2 blocks per
  # sequence is half empty) against the rectangle.
  OUT=$RUN/decode32 BUILD_DIR=/tmp/ab_build_base STEPS=bench_gqa \
    BENCH_GQA_ARGS='--packed --batch 32 --groups 32:4 --seqlens-q 1,4' \
    BENCH_GQA_ENV_B='CUFLASH_FWD_ROW_BLOCK_LIST=off' timeout 90 bash tools/gpu_check.sh >/dev/null 2>&1
  cat "$RUN/decode32/summary.txt" 2>/dev/null
fi

if [[ -d ab_lsc ]] && (( $(left) > 200 )); then
  echo "== 4 long-sequence clear ($(left) s left)"
  OUT=$RUN/lsc VARIANTS="base lsc@ab_lsc" HDIMS="64;128" REGEX='^flash_(fwd|bwd)_hdim(64|128)_bf16_sm90$' \
    BENCH=varlen BENCH_ARGS='--hdims 64,128 --directions bwd --layouts skewed:64:16384,skewed:16:8192,uniform:128:512' \
    PASSES=2 STAGGER=10 timeout $(( $(left) - 10 )) bash tools/gpu_ab.sh
fi
echo "done ($(left) s left)"
