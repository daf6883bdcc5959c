#!/usr/bin/env bash
# One call on the lent H200: configure, build, run the GPU tests, a compute-sanitizer pass,
# a SASS check and the forward and backward benchmarks, writing logs and results under $OUT.
#
#   tools/gpu_check.sh                       # CUFLASH_KERNEL_SET=ci (hdim128 bf16), every step
#   KERNEL_SET=all tools/gpu_check.sh        # every head dim and dtype
#   KERNEL_SET=custom HDIMS="64;128;256" DTYPES=bf16 STEPS=build,test,bench tools/gpu_check.sh
#   STEPS=build,bench_bwd BENCH_BWD_ARGS="--hdims 128" tools/gpu_check.sh
#
# Environment: KERNEL_SET (ci|all|custom), HDIMS / DTYPES (for custom), FEATURES (CUFLASH_FEATURES), STEPS (comma list of
# build,test,test_each,pytest,sanitize,sass,bench,bench_bwd,bench_gqa,bench_flex,bench_varlen,l2_probe,dsmem_probe,kernel_times,profile), GTEST_FILTER (default *Gpu*), TEST_TIMEOUT, TEST_SHARDS (default 4), TEST_ENV_B / GTEST_FILTER_B and TEST_ENV_C / GTEST_FILTER_C (the tests again under extra settings), SANITIZE_FILTER (memcheck),
# KERNEL_TIMES_ARGS (';'-separated argument sets of bench/kernel_times.py, default: the hdim 128 / 256 backward and
# the hdim128 forward, cuflash and cuDNN), RACECHECK_FILTER, PER_TEST_TIMEOUT (test_each), PYTEST_K (a -k expression), PYTEST_ARGS, JIT_MODULES (0: do not build the GPU tests' callable modules first), PYTEST_TIMEOUT, BENCH_ARGS, BENCH_ENV_B (run the
# benchmark a second time with these VAR=value settings), BENCH_BWD_ARGS (bench/bench_bwd.py), BENCH_BWD_ARGS_B / BENCH_BWD_ENV_B, _C and _D (more passes with these arguments / VAR=value settings, tagged _b / _c / _d),
# BENCH_BWD_TIMEOUT (seconds, default 300: a hung backward kernel ends the step, not the call), PROFILE
# (ncu targets for the profile step, see there), PROFILE_KERNEL_ARGS, BUILD_DIR, CMAKE_EXTRA, BENCH_FLEX_ARGS and BENCH_GQA_ARGS with passes
# _B / _C / _D as bench_bwd's (BENCH_FLEX_ENV_B: the flex pass again under these settings, tagged _b), BENCH_FLEX_TIMEOUT, BENCH_GQA_TIMEOUT, BENCH_VARLEN_ARGS (bench_varlen.py), BENCH_VARLEN_TIMEOUT, JOBS.
# Carry `.cutlass` (CUTLASS headers) and, where the machine has no GoogleTest, `.deps` (a
# googletest source tree at .deps/googletest); tools/prepare_device_carry.sh makes both here.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/gpu_check_out}
mkdir -p "$OUT"
KERNEL_SET=${KERNEL_SET:-ci}
HDIMS=${HDIMS:-128}
DTYPES=${DTYPES:-bf16}
FEATURES=${FEATURES:-softcap;split;flex;paged;packgqa}
STEPS=${STEPS:-build,test,sanitize,sass,bench,bench_bwd}
GTEST_FILTER=${GTEST_FILTER:-*Gpu*}
SANITIZE_FILTER=${SANITIZE_FILTER:-*varlen_causal_gqa_bf16_d128*:*sink_fp16_local_bf16_d128*:*causal_seqused_page3_bf16_d128*:*causal_seqused_page128_bf16_d128*:*split3_varlen_keyless_causal_gqa_bf16_d128*:*varlen_document_softcap_bf16_d128*:*GpuBackward*deterministic_causal_gqa_sink_bf16_d128*}
RACECHECK_FILTER=${RACECHECK_FILTER:-*dense_bf16_d128*:*varlen_causal_gqa_bf16_d128*:*dense_gqa_page16_bf16_d128*:*dense_gqa_page256_bf16_d128*:*GpuForwardFlex*alibi_gqa_bf16_d128*}
BENCH_ARGS=${BENCH_ARGS:-}
BENCH_BWD_ARGS=${BENCH_BWD_ARGS:-}
BENCH_BWD_TIMEOUT=${BENCH_BWD_TIMEOUT:-300}
JOBS=${JOBS:-$(nproc)}
# BUILD_DIR / CMAKE_EXTRA: a second build beside the first (say, a compile-time switch in
# CMAKE_EXTRA="-DCMAKE_CUDA_FLAGS=-DNAME") so that two variants can be timed in one call.
BUILD=${BUILD_DIR:-$ROOT/build-gpu}
SUMMARY=$OUT/summary.txt
status=0

has_step() { [[ ",$STEPS," == *",$1,"* ]]; }
note() { echo "$*" | tee -a "$SUMMARY"; }
# The Python package with the extension just built, for the benchmarks.
pkg=/tmp/cuflash_pkg
make_pkg() { rm -rf "$pkg" && mkdir -p "$pkg" && cp -r "$ROOT/python/cuflash" "$pkg/" && cp "$BUILD"/python/_C*.so "$pkg/cuflash/"; }

note "gpu_check $(date -u +%FT%TZ) kernel_set=$KERNEL_SET hdims=$HDIMS dtypes=$DTYPES steps=$STEPS"
# The second passes' settings are VAR=value lists: checked before the build, so that a typo
# costs no device time.
for list_name in TEST_ENV_B TEST_ENV_C BENCH_ENV_B BENCH_{BWD,FLEX,GQA}_ENV_{B,C,D}; do
  for setting in ${!list_name:-}; do
    [[ $setting =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || { note "$list_name: '$setting' is not VAR=value"; exit 2; }
  done
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader 2>&1 | tee -a "$SUMMARY"

if has_step build; then
  gtest_args=()
  if ! ls /usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake /usr/lib/cmake/GTest/GTestConfig.cmake \
       /usr/local/lib/cmake/GTest/GTestConfig.cmake >/dev/null 2>&1; then
    if [[ -d $ROOT/.deps/googletest ]]; then
      cmake -S "$ROOT/.deps/googletest" -B /tmp/gtest-build -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_INSTALL_PREFIX=/tmp/gtest -DBUILD_GMOCK=OFF >"$OUT/build.log" 2>&1 &&
        cmake --build /tmp/gtest-build -j "$JOBS" >>"$OUT/build.log" 2>&1 &&
        cmake --install /tmp/gtest-build >>"$OUT/build.log" 2>&1
      gtest_args=(-DGTest_ROOT=/tmp/gtest)
    fi
  fi
  start=$(date +%s)
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCUFLASH_KERNEL_SET="$KERNEL_SET" \
    -DCUFLASH_HDIMS="$HDIMS" -DCUFLASH_DTYPES="$DTYPES" -DCUFLASH_FEATURES="$FEATURES" -DCUFLASH_BUILD_PYTHON=ON \
    -DPython_EXECUTABLE="$(command -v python3)" "${gtest_args[@]}" ${CMAKE_EXTRA:-} >>"$OUT/build.log" 2>&1 &&
    cmake --build "$BUILD" -j "$JOBS" >>"$OUT/build.log" 2>&1
  rc=$?
  note "build: rc=$rc in $(( $(date +%s) - start )) s"
  grep -E "C75[0-9]{2}|spill|error" "$OUT/build.log" | sort | uniq -c | head -20 | tee -a "$SUMMARY"
  if [[ $rc -ne 0 ]]; then tail -40 "$OUT/build.log"; exit 1; fi
fi

TESTS=$BUILD/tests/cpp/cuflash_tests
if has_step test_each; then
  # Every test in its own process under its own timeout: a hang or a sticky CUDA error in one
  # kernel is reported against that test and the others still run.
  start=$(date +%s)
  : >"$OUT/tests_each.log"
  pass=0; skip=0; fail=0; hung=0
  for t in $("$TESTS" --gtest_filter="$GTEST_FILTER" --gtest_list_tests |
             awk '/^[^ ]/ {suite=$1} /^  / {print suite $1}'); do
    echo "== $t" >>"$OUT/tests_each.log"
    timeout "${PER_TEST_TIMEOUT:-60}" "$TESTS" --gtest_filter="$t" --gtest_brief=1 >"$OUT/one_test.log" 2>&1
    rc=$?
    cat "$OUT/one_test.log" >>"$OUT/tests_each.log"
    if [[ $rc -eq 0 ]] && grep -q '^\[  SKIPPED \] 1 test' "$OUT/one_test.log"; then skip=$((skip + 1))
    elif [[ $rc -eq 0 ]]; then pass=$((pass + 1))
    elif [[ $rc -eq 124 ]]; then hung=$((hung + 1)); note "HUNG: $t"
    else fail=$((fail + 1)); note "FAILED: $t"; fi
  done
  rm -f "$OUT/one_test.log"
  note "tests_each ($GTEST_FILTER): passed=$pass skipped=$skip failed=$fail hung=$hung in $(( $(date +%s) - start )) s"
  [[ $((fail + hung)) -ne 0 ]] && status=1
fi

# The GPU tests over a gtest filter, under extra VAR=value settings, in TEST_SHARDS processes (gtest
# sharding) side by side: the CPU reference and the naive computations of small cases use few of
# the machine's cores, the kernels little of the GPU. A producer/consumer disagreement in a kernel
# hangs rather than fails: each shard is bounded so the rest of the call (and its logs) still
# comes back. Line-buffered and not brief, so that a run the limit stops leaves every result so
# far and the test it stopped in. Logs <tag>_shard<i>.log, merged into <tag>.log.
run_tests() {
  local tag=$1 filter=$2 settings=$3 shards=${TEST_SHARDS:-4} start rc r i
  start=$(date +%s)
  local pids=()
  for ((i = 0; i < shards; i++)); do
    # shellcheck disable=SC2086
    env $settings GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i timeout "${TEST_TIMEOUT:-420}" stdbuf -oL -eL \
      "$TESTS" --gtest_filter="$filter" --gtest_output="xml:$OUT/${tag}_shard$i.xml" >"$OUT/${tag}_shard$i.log" 2>&1 &
    pids+=($!)
  done
  rc=0
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"
    r=$?
    [[ $r -ne 0 && $rc -ne 124 ]] && rc=$r
    [[ $r -eq 124 ]] && note "$tag shard $i: timed out after ${TEST_TIMEOUT:-420} s (hang?); last test started: $(grep -E '^\[ RUN' "$OUT/${tag}_shard$i.log" | tail -1 | cut -c1-200)"
  done
  cat "$OUT/${tag}"_shard*.log >"$OUT/$tag.log"
  count() { grep -cE "$1" "$OUT/$tag.log"; }
  note "$tag ($filter${settings:+, $settings}, $shards shards): rc=$rc in $(( $(date +%s) - start )) s; $(count '^\[       OK \]') passed, $(count '^\[  SKIPPED \] [A-Za-z].*\([0-9]+ ms\)$') skipped, $(count '^\[  FAILED  \] [A-Za-z].*\([0-9]+ ms\)$') failed"
  grep -E "^\[  FAILED  \] [A-Za-z].*\([0-9]+ ms\)$|Failure|error" "$OUT/$tag.log" | head -30 | tee -a "$SUMMARY"
  [[ $rc -ne 0 ]] && status=1
}

if has_step test; then
  run_tests tests "$GTEST_FILTER" ""
  # The tests again under extra VAR=value settings (a launch-time switch such as
  # CUFLASH_FWD_SHORT_KERNEL=short): TEST_ENV_B over GTEST_FILTER_B, TEST_ENV_C over GTEST_FILTER_C
  # (each defaulting to GTEST_FILTER), logs tests_b.log / tests_c.log.
  for pass in B C; do
    env_var=TEST_ENV_$pass filter_var=GTEST_FILTER_$pass
    [[ -z ${!env_var:-} ]] && continue
    run_tests "tests_${pass,,}" "${!filter_var:-$GTEST_FILTER}" "${!env_var}"
  done
fi

if has_step pytest; then
  make_pkg
  start=$(date +%s)
  # The modules of the GPU tests' score_mod / mask_mod callables, built in parallel up front
  # (about a minute each with nvcc; one after another inside the tests they would add up).
  # JIT_MODULES=0 skips this where no such test is selected.
  if [[ ${JIT_MODULES:-1} != 0 ]]; then
    CUTLASS_DIR=${CUTLASS_DIR:-$ROOT/.cutlass} CUFLASH_SOURCE_DIR=$ROOT PYTHONPATH="$pkg:$ROOT/tests/python" \
      timeout 300 python3 "$ROOT/tests/python/gpu_callables.py" >"$OUT/jit_modules.log" 2>&1
    note "callable modules: rc=$? in $(( $(date +%s) - start )) s"
    start=$(date +%s)
  fi
  # Callables compile at run time against the carried CUTLASS headers and this tree's kernel headers
  # (the package copy in $pkg is not inside the checkout). -v, unbuffered: a run cut short by the
  # timeout still shows the test it was in.
  # shellcheck disable=SC2086
  CUTLASS_DIR=${CUTLASS_DIR:-$ROOT/.cutlass} CUFLASH_SOURCE_DIR=$ROOT \
  PYTHONUNBUFFERED=1 PYTHONPATH="$pkg:$ROOT/tests/python" timeout "${PYTEST_TIMEOUT:-300}" python3 -m pytest -v -rs \
    -p no:cacheprovider "$ROOT/tests/python" ${PYTEST_K:+-k "$PYTEST_K"} ${PYTEST_ARGS:-} >"$OUT/pytest.log" 2>&1
  rc=$?
  note "pytest: rc=$rc in $(( $(date +%s) - start )) s; $(tail -1 "$OUT/pytest.log")"
  grep -E "^FAILED|^ERROR" "$OUT/pytest.log" | head -30 | tee -a "$SUMMARY"
  [[ $rc -ne 0 ]] && status=1
fi

if has_step sanitize; then
  start=$(date +%s)
  compute-sanitizer --tool memcheck --error-exitcode 3 "$TESTS" --gtest_filter="$SANITIZE_FILTER" --gtest_brief=1 \
    >"$OUT/sanitize.log" 2>&1
  rc=$?
  note "memcheck ($SANITIZE_FILTER): rc=$rc in $(( $(date +%s) - start )) s; $(grep -E 'ERROR SUMMARY' "$OUT/sanitize.log" | tail -1)"
  [[ $rc -ne 0 ]] && status=1
  start=$(date +%s)
  compute-sanitizer --tool racecheck --error-exitcode 3 "$TESTS" --gtest_filter="$RACECHECK_FILTER" --gtest_brief=1 \
    >>"$OUT/sanitize.log" 2>&1
  rc=$?
  note "racecheck ($RACECHECK_FILTER): rc=$rc in $(( $(date +%s) - start )) s; $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/sanitize.log" | tail -1)"
  [[ $rc -ne 0 ]] && status=1
fi

if has_step sass; then
  {
    for obj in "$BUILD"/CMakeFiles/cuflash.dir/src/instantiations/*.o; do
      [[ -e $obj ]] || continue
      sass=$(cuobjdump --dump-sass "$obj")
      printf '%s HGMMA=%s HMMA=%s LDL=%s STL=%s SETMAXREG=%s\n' "$(basename "$obj")" \
        "$(grep -c HGMMA <<<"$sass")" "$(grep -c ' HMMA' <<<"$sass")" "$(grep -c ' LDL' <<<"$sass")" \
        "$(grep -c ' STL' <<<"$sass")" "$(grep -c SETMAXREG <<<"$sass")"
    done
  } >"$OUT/sass.log" 2>&1
  note "sass:"; cat "$OUT/sass.log" | tee -a "$SUMMARY" >/dev/null
fi

if has_step bench; then
  make_pkg
  start=$(date +%s)
  # shellcheck disable=SC2086
  PYTHONUNBUFFERED=1 PYTHONPATH="$pkg" python3 "$ROOT/bench/bench_fwd.py" --out "$OUT" $BENCH_ARGS 2>&1 | tee "$OUT/bench.log"
  rc=${PIPESTATUS[0]}
  note "bench: rc=$rc in $(( $(date +%s) - start )) s"
  [[ $rc -ne 0 ]] && status=1
  if [[ -n ${BENCH_ENV_B:-} ]]; then
    # A second pass under extra environment (an A/B of a launch-time switch), tagged _b.
    # shellcheck disable=SC2086
    env $BENCH_ENV_B PYTHONUNBUFFERED=1 PYTHONPATH="$pkg" python3 "$ROOT/bench/bench_fwd.py" --out "$OUT" --tag _b \
      $BENCH_ARGS 2>&1 | tee "$OUT/bench_b.log"
  fi
fi

# run_bench NAME TIMEOUT ARGS [VAR=value ... TAG]: bench/bench_NAME.py under a timeout, its output
# in bench_NAME.log; with a tag, a further pass (under the settings, if any) in bench_NAME_TAG.log,
# its files tagged _TAG.
run_bench() {
  make_pkg
  local start=$(date +%s) settings=${4:-} tag=${5:-}
  # shellcheck disable=SC2086
  env $settings PYTHONUNBUFFERED=1 PYTHONPATH="$pkg" timeout "$2" python3 "$ROOT/bench/bench_$1.py" --out "$OUT" \
    ${tag:+--tag _$tag} $3 2>&1 | tee "$OUT/bench_$1${tag:+_$tag}.log"
  local rc=${PIPESTATUS[0]} extra=""
  [[ $rc -eq 124 ]] && extra="; timed out after $2 s (what it measured is in its JSON)"
  if [[ $1 == bwd ]]; then
    local skipped
    skipped=$(grep -c '"skipped": "' "$OUT/bwd_sm90${tag:+_$tag}.json" 2>/dev/null || true)
    extra+="; skipped records: ${skipped:-no JSON}"
  fi
  note "bench_$1${tag:+ (${tag^^}: $settings $3)}: rc=$rc in $(( $(date +%s) - start )) s$extra"
  [[ $rc -ne 0 ]] && status=1
}
# run_passes NAME TIMEOUT: bench/bench_NAME.py with BENCH_<NAME>_ARGS, then a pass for each of B /
# C / D that sets BENCH_<NAME>_ARGS_<pass> (other arguments; default the first pass's) or
# BENCH_<NAME>_ENV_<pass> (VAR=value settings: an A/B of a launch-time switch), tagged _b / _c / _d.
run_passes() {
  local name=$1 upper=${1^^}
  local args_var=BENCH_${upper}_ARGS
  run_bench "$name" "$2" "${!args_var:-}"
  local pass
  for pass in B C D; do
    local pass_args=BENCH_${upper}_ARGS_$pass pass_env=BENCH_${upper}_ENV_$pass
    [[ -z ${!pass_args:-}${!pass_env:-} ]] && continue
    run_bench "$name" "$2" "${!pass_args:-${!args_var:-}}" "${!pass_env:-}" "${pass,,}"
  done
}
has_step bench_bwd && run_passes bwd "$BENCH_BWD_TIMEOUT"
has_step bench_gqa && run_passes gqa "${BENCH_GQA_TIMEOUT:-180}"
has_step bench_flex && run_passes flex "${BENCH_FLEX_TIMEOUT:-300}"
has_step bench_varlen && run_passes varlen "${BENCH_VARLEN_TIMEOUT:-180}"

# A standalone device probe of bench/ (no cuflash library): compiled, run, its output in the summary.
run_probe() {  # run_probe STEP NAME: bench/NAME.cu
  local step=$1 name=$2
  { nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o "/tmp/$name" "$ROOT/bench/$name.cu" &&
    timeout 120 "/tmp/$name"; } >"$OUT/$name.txt" 2>&1
  rc=$?
  note "$step: rc=$rc"
  [[ $rc -ne 0 ]] && status=1
  tee -a "$SUMMARY" <"$OUT/$name.txt"
}
# The card's L2 -> shared memory read rate by bulk copies.
has_step l2_probe && run_probe l2_probe l2_read_probe
# Tile exchange between the two CTAs of a cluster through distributed shared memory.
has_step dsmem_probe && run_probe dsmem_probe dsmem_exchange_probe

if has_step kernel_times; then
  # Each kernel of one call, cuflash's and cuDNN's, with the gaps between them (bench/kernel_times.py).
  make_pkg
  start=$(date +%s)
  IFS=';' read -ra sets <<<"${KERNEL_TIMES_ARGS:---hdim 256 --backward;--hdim 256 --backward --impl cudnn;--hdim 128 --backward;--hdim 128 --backward --impl cudnn;--hdim 128;--hdim 128 --impl cudnn}"
  for args in "${sets[@]}"; do
    # shellcheck disable=SC2086
    PYTHONPATH="$pkg" timeout 60 python3 "$ROOT/bench/kernel_times.py" $args --calls 2 2>&1 | grep -v -e '_warn_once' -e 'Warning'
  done >"$OUT/kernel_times.txt"
  note "kernel_times: ${#sets[@]} calls in $(( $(date +%s) - start )) s (kernel_times.txt)"
fi

if has_step profile; then
  # Nsight Compute on single launches: PROFILE is a list of kind:hdim:seqlen:causal[:det] (kind
  # fwd or bwd; det 1 for a deterministic backward), e.g. "bwd:256:4096:0 bwd:256:4096:0:1
  # fwd:128:2048:0"; one text report per entry. Kind decode is decode:hdim:seqlen_k:HQ:HKV[:seqlen_q]
  # (bench_gqa's decode step, batch 4, the forward kernel; PROFILE_KERNEL_ARGS for the combine).
  make_pkg
  for spec in ${PROFILE:-bwd:256:4096:0 bwd:128:4096:0}; do
    IFS=: read -r kind hdim seqlen causal det <<<"$spec"
    case $kind in
      fwd) kernel=regex:flash_fwd_kernel extra=--no-backward name="ncu_fwd_d${hdim}_s${seqlen}_c${causal}${det:+_det$det}" ;;
      decode)
        IFS=: read -r kind hdim seqlen heads heads_kv rows <<<"$spec"
        causal=1 kernel=regex:flash_fwd_kernel
        extra="--no-backward --decode $heads:$heads_kv --decode-seqlen-q ${rows:-1}"
        name="ncu_decode_d${hdim}_s${seqlen}_h${heads}_${heads_kv}_q${rows:-1}" ;;
      *) kernel=regex:flash_bwd_kernel_sm90 extra="--deterministic ${det:-0}"
         name="ncu_${kind}_d${hdim}_s${seqlen}_c${causal}${det:+_det$det}" ;;
    esac
    start=$(date +%s)
    rm -f "/tmp/$name.ncu-rep"  # a failed run must not report an older profile
    # PROFILE_KERNEL_ARGS replaces the kernel choice, e.g. the stream-K pieces' kernel:
    # "--kernel-name-base mangled -k regex:Lb1EEEEEEEvNT_6ParamsE -s 1".
    # shellcheck disable=SC2086
    PYTHONPATH="$pkg" timeout "${PROFILE_TIMEOUT:-120}" ncu --set full -o "/tmp/$name" -f \
      ${PROFILE_KERNEL_ARGS:--k $kernel -s 1} -c 1 \
      python3 "$ROOT/bench/profile_kernel.py" --hdim "$hdim" --seqlen "$seqlen" --causal "$causal" $extra \
      >"/tmp/$name.log" 2>&1
    note "profile $spec: rc=$? in $(( $(date +%s) - start )) s"
    # The details page as text, and the instructions where the warps stall most (source page).
    { cat "/tmp/$name.log"; ncu --import "/tmp/$name.ncu-rep" --page details; } >"$OUT/$name.txt" 2>&1
    ncu --import "/tmp/$name.ncu-rep" --page source --csv --print-source sass >"/tmp/${name}_source.csv" 2>&1
    python3 "$ROOT/bench/ncu_stall_top.py" "/tmp/${name}_source.csv" --top 60 --dump "$OUT/${name}_sass.txt" \
      >"$OUT/${name}_stalls.txt" 2>&1 ||
      note "profile $spec: no stall table (see ${name}_stalls.txt)"
  done
fi

note "gpu_check done: status=$status"
cat "$SUMMARY" | tail -60
exit $status
