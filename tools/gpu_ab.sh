#!/usr/bin/env bash
# A/B of compile-time variants in one call on the lent H200: builds each variant of one kernel
# selection side by side (tools/gpu_check.sh with its own BUILD_DIR and CUFLASH_AB_DEFINES), runs the
# GPU tests on one of them, then a benchmark over the variants in alternating passes, appending
# everything to $OUT/all.txt as it goes (a call cut short still returns what it measured).
#
#   VARIANTS="base new:-DCUFLASH_SOME_SWITCH=1" HDIMS=128 FEATURES="flex;split" \
#   REGEX='^flash_fwd_hdim128_bf16_(flex_(split_)?)?sm90$' TEST_VARIANT=new GTEST_FILTER='*ForwardFlex*' \
#   BENCH=flex BENCH_ARGS="--hdims 128 --seqlens 2048,8192" PASSES=2 tools/gpu_ab.sh
#
# VARIANTS: space-separated NAME, NAME:FLAGS (FLAGS: -DNAME=VALUE switches joined by commas, no
# spaces, for host and device code: CUFLASH_AB_DEFINES) or NAME@DIR (a copy of the tree with the
# files under DIR, a folder of the working tree laid out as the repository, put over it: e.g. the
# committed version of a changed source file as the base of an A/B, without a switch in the code).
# KERNEL_SET (default custom), HDIMS, DTYPES (default bf16), FEATURES, REGEX (CUFLASH_KERNEL_REGEX):
# the kernel selection of every variant. TEST_VARIANT / GTEST_FILTER / TEST_TIMEOUT: the GPU tests
# (none without TEST_VARIANT). BENCH: a bench/bench_NAME.py step of gpu_check (fwd, bwd, flex, gqa, varlen;
# none if empty), BENCH_ARGS its arguments, PASSES the rounds over the variants (default 2).
# BENCH_ENV_B: a second pass of each variant in each round under these VAR=value settings (a
# launch-time switch: e.g. a schedule that only one variant knows, read by both).
# STAGGER: seconds between the builds' starts (default 40; they share the GoogleTest build).
# DRY_RUN=1 prints the gpu_check calls instead of running them.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/gpu_check_out}
mkdir -p "$OUT"
ALL=$OUT/all.txt
: >"$ALL"
VARIANTS=${VARIANTS:?VARIANTS: the variants to build, e.g. "base new:-DNAME=1"}
export KERNEL_SET=${KERNEL_SET:-custom} DTYPES=${DTYPES:-bf16}
[[ -n ${HDIMS:-} ]] && export HDIMS
[[ -n ${FEATURES:-} ]] && export FEATURES
PASSES=${PASSES:-2}
STAGGER=${STAGGER:-40}

log() { echo "$*" >>"$ALL"; }
run() {  # run TREE LOGFILE VAR=value... : TREE/tools/gpu_check.sh under those settings
  local tree=$1 logfile=$2
  shift 2
  if [[ ${DRY_RUN:-0} == 1 ]]; then
    echo "env $* bash $tree/tools/gpu_check.sh > $logfile" | tee -a "$ALL"
    return 0
  fi
  env "$@" bash "$tree/tools/gpu_check.sh" >"$logfile" 2>&1
}
name_of() { local name=${1%%:*}; echo "${name%%@*}"; }
flags_of() { [[ $1 == *:* ]] && echo "${1#*:}"; }
# The overlay folder is read before any ':', so that an '@' inside FLAGS is not taken for one.
overlay_of() { local head=${1%%:*}; [[ $head == *@* ]] && echo "${head#*@}"; }
tree_named() { local i; for i in "${!names[@]}"; do [[ ${names[$i]} == "$1" ]] && echo "${trees[$i]}"; done; }
tree_of() { [[ -n $(overlay_of "$1") ]] && echo "/tmp/ab_tree_$(name_of "$1")" || echo "$ROOT"; }
# Overlay variants build from their own tree in their own folder, made anew each call: a tree
# copied by tar keeps the old files' times, so a file dropped from the overlay could come back
# older than the objects built from it, and a folder configured from another source tree is
# refused by CMake.
build_of() { [[ -n $(overlay_of "$1") ]] && echo "/tmp/ab_build_$(name_of "$1")_overlay" || echo "/tmp/ab_build_$(name_of "$1")"; }
build_named() { local i; for i in "${!names[@]}"; do [[ ${names[$i]} == "$1" ]] && echo "${builds[$i]}"; done; }

log "gpu_ab $(date -u +%FT%TZ) variants: $VARIANTS; kernel_set=$KERNEL_SET hdims=${HDIMS:-} dtypes=$DTYPES features=${FEATURES:-} regex=${REGEX:-}"
names=()
trees=()
builds=()
for variant in $VARIANTS; do
  name=$(name_of "$variant")
  [[ $name =~ ^[A-Za-z0-9_]+$ ]] || { echo "VARIANTS: '$name' is not a plain name" >&2; exit 2; }
  overlay=$(overlay_of "$variant")
  [[ ${variant%%:*} == *@ ]] && { echo "VARIANTS: '$variant' names no folder after '@'" >&2; exit 2; }
  if [[ -n $overlay ]]; then
    [[ -d $ROOT/$overlay ]] || { echo "VARIANTS: '$overlay' is not a folder of the tree" >&2; exit 2; }
    tree=$(tree_of "$variant")
    if [[ ${DRY_RUN:-0} != 1 ]]; then
      rm -rf "$tree" "$(build_of "$variant")" && mkdir -p "$tree" &&
        (cd "$ROOT" && tar cf - --exclude='./build*' --exclude=./gpu_check_out .) | (cd "$tree" && tar xf -) &&
        cp -r "$ROOT/$overlay/." "$tree/" || { echo "VARIANTS: could not lay out $tree" >&2; exit 2; }
    fi
    log "variant $name: the tree with $(cd "$ROOT/$overlay" && find . -type f | sort | tr '\n' ' ')over it"
  fi
  names+=("$name")
  trees+=("$(tree_of "$variant")")
  builds+=("$(build_of "$variant")")
done
if [[ -n ${TEST_VARIANT:-} && " ${names[*]} " != *" $TEST_VARIANT "* ]]; then
  echo "TEST_VARIANT: '$TEST_VARIANT' is not among VARIANTS ($VARIANTS)" >&2
  exit 2
fi
# A benchmark of the backward runs the forward first (for the output and lse it differentiates):
# a kernel regex that leaves the forward kernels out builds and tests, then times nothing.
if [[ -n ${REGEX:-} && ( ${BENCH:-} == bwd || ( ${BENCH:-} == varlen && ${BENCH_ARGS:-} == *bwd* ) ) ]]; then
  for hdim in ${HDIMS//;/ }; do
    kernel="flash_fwd_hdim${hdim}_${DTYPES%%;*}_sm90"
    if ! [[ $kernel =~ $REGEX ]]; then
      echo "REGEX: '$REGEX' leaves out $kernel, whose forward BENCH=$BENCH's backward runs first" >&2
      exit 2
    fi
  done
fi

first=1
for variant in $VARIANTS; do
  name=$(name_of "$variant")
  flags=$(flags_of "$variant")
  extra=${REGEX:+-DCUFLASH_KERNEL_REGEX=$REGEX}
  # Device and host code alike (a switch that the host's sizes read too must agree with the kernels).
  # Always set (and the compilers' flags reset), so that a build folder reused under the same
  # name drops an earlier variant's switches.
  defines=${flags//,-D/;}
  extra="$extra -DCUFLASH_AB_DEFINES=${defines#-D} -DCMAKE_CUDA_FLAGS= -DCMAKE_CXX_FLAGS="
  [[ $name != "${TEST_VARIANT:-}" ]] && extra="$extra -DCUFLASH_BUILD_TESTS=OFF"
  [[ $first == 1 ]] || { [[ ${DRY_RUN:-0} == 1 ]] || sleep "$STAGGER"; }
  first=0
  # gpu_check appends to its summary, and a warm machine keeps /tmp between calls.
  rm -rf "/tmp/ab_out_$name"
  run "$(tree_of "$variant")" "/tmp/ab_build_$name.log" OUT="/tmp/ab_out_$name" BUILD_DIR="$(build_of "$variant")" STEPS=build \
    CMAKE_EXTRA="$extra" &
done
wait
for name in "${names[@]}"; do
  log "== build $name"
  cat "/tmp/ab_out_$name/summary.txt" >>"$ALL" 2>/dev/null
done

if [[ -n ${TEST_VARIANT:-} ]]; then
  rm -rf /tmp/ab_tests
  run "$(tree_named "$TEST_VARIANT")" /tmp/ab_tests.log OUT=/tmp/ab_tests BUILD_DIR="$(build_named "$TEST_VARIANT")" STEPS=test \
    GTEST_FILTER="${GTEST_FILTER:-*Gpu*}" TEST_TIMEOUT="${TEST_TIMEOUT:-240}"
  log "== tests on $TEST_VARIANT"
  grep "^tests" /tmp/ab_tests/summary.txt >>"$ALL" 2>/dev/null
  grep -E "^\[  FAILED  \]|Failure" /tmp/ab_tests/tests.log 2>/dev/null | head -40 >>"$ALL"
fi

if [[ -n ${BENCH:-} ]]; then
  case $BENCH in
    fwd) step=bench settings=(BENCH_ARGS="${BENCH_ARGS:-}") logname=bench.log env_b=BENCH_ENV_B ;;
    bwd) step=bench_bwd settings=(BENCH_BWD_ARGS="${BENCH_ARGS:-}") logname=bench_bwd.log env_b=BENCH_BWD_ENV_B ;;
    flex) step=bench_flex settings=(BENCH_FLEX_ARGS="${BENCH_ARGS:-}" BENCH_FLEX_TIMEOUT="${BENCH_TIMEOUT:-300}") logname=bench_flex.log env_b=BENCH_FLEX_ENV_B ;;
    gqa) step=bench_gqa settings=(BENCH_GQA_ARGS="${BENCH_ARGS:-}") logname=bench_gqa.log env_b=BENCH_GQA_ENV_B ;;
    varlen) step=bench_varlen settings=(BENCH_VARLEN_ARGS="${BENCH_ARGS:-}") logname=bench_varlen.log env_b=BENCH_VARLEN_ENV_B ;;
    *) echo "BENCH: '$BENCH' is not one of fwd, bwd, flex, gqa, varlen" >&2; exit 2 ;;
  esac
  # BENCH_ENV_B: gpu_check's second pass of the benchmark under these settings (its variable for
  # that benchmark, env_b), logged beside the first pass's with _b.
  [[ -n ${BENCH_ENV_B:-} ]] && settings+=("$env_b=$BENCH_ENV_B")
  logname_b=${logname%.log}_b.log
  for pass in $(seq "$PASSES"); do
    for name in "${names[@]}"; do
      log "##### $name (pass $pass) $BENCH ${BENCH_ARGS:-}"
      rm -rf "/tmp/ab_bench_$name"  # no earlier call's logs read as this pass's
      run "$(tree_named "$name")" "/tmp/ab_bench_$name.log" OUT="/tmp/ab_bench_$name" BUILD_DIR="$(build_named "$name")" STEPS="$step" \
        "${settings[@]}"
      grep -v "^$" "/tmp/ab_bench_$name/$logname" 2>/dev/null | tail -60 >>"$ALL"
      # The second pass under BENCH_ENV_B (gpu_check), when set.
      if [[ -n ${BENCH_ENV_B:-} && -s /tmp/ab_bench_$name/$logname_b ]]; then
        log "## $name (pass $pass) under ${BENCH_ENV_B:-}"
        grep -v "^$" "/tmp/ab_bench_$name/$logname_b" | tail -60 >>"$ALL"
      fi
    done
  done
fi
log "gpu_ab done $(date -u +%FT%TZ)"
