#!/usr/bin/env bash
# Backward benchmark of several committed trees side by side in one call (a regression hunt):
# each tree is built with its own tools/gpu_check.sh in its own folder, then bench/bench_bwd.py
# runs over the entries in alternating passes; the table lines go to $OUT/all.txt as they come.
#
#   for c in 311fc96 dee146d; do git archive -o ab_$c.tar $c; done   # on the machine with git
#   ENTRIES="cur 311fc96 dee146d cur:CUFLASH_BWD_DQ_CLEAR=memset" HDIMS="128;256" \
#   BENCH_BWD_ARGS="--hdims 128,256 --seqlens 2048 --causal 0,1 --impls cuflash,cuflash_det" tools/gpu_trees.sh
#
# ENTRIES: space-separated NAME or NAME:VAR=value[,VAR=value] (values without commas); NAME is `cur` (this working tree)
# or a commit whose `git archive` is ab_NAME.tar in the repository root (an untracked file, so it
# travels with the tree). A tree is built once however many entries name it.
# Each entry runs its own tree's bench/bench_bwd.py (the benchmark script is compared with the code).
# HDIMS / DTYPES (default bf16): the kernels built (forward and backward of those, no tests).
# PASSES: rounds over the entries (default 2). STAGGER: seconds between the builds' starts. The
# builds share the machine's cores (JOBS each: nproc / trees). Exits 1 if a build or a pass failed.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/gpu_check_out}
mkdir -p "$OUT"
ALL=$OUT/all.txt
: >"$ALL"
ENTRIES=${ENTRIES:?ENTRIES: the trees to compare, e.g. "cur dee146d"}
HDIMS=${HDIMS:?HDIMS: e.g. "128;256"}
DTYPES=${DTYPES:-bf16}
BENCH_BWD_ARGS=${BENCH_BWD_ARGS:?BENCH_BWD_ARGS: the bench_bwd.py arguments}
PASSES=${PASSES:-2}
STAGGER=${STAGGER:-20}
log() { echo "$*" >>"$ALL"; }

tree_of() { [[ $1 == cur ]] && echo "$ROOT" || echo "/tmp/t_$1"; }
hdim_alt=$(echo "$HDIMS" | tr ';' '|')
dtype_alt=$(echo "$DTYPES" | tr ';' '|')
regex="^flash_(fwd|bwd)_hdim($hdim_alt)_($dtype_alt)_sm90\$"
log "gpu_trees $(date -u +%FT%TZ) entries: $ENTRIES; hdims=$HDIMS dtypes=$DTYPES; $BENCH_BWD_ARGS"

# The distinct trees, each archive checked before any build starts.
names=()
for entry in $ENTRIES; do
  name=${entry%%:*}
  [[ " ${names[*]} " == *" $name "* ]] && continue
  if [[ $name != cur && ! -f $ROOT/ab_$name.tar ]]; then
    log "$name: no ab_$name.tar in the repository root"
    exit 2
  fi
  names+=("$name")
done
jobs=$(( $(nproc) / ${#names[@]} ))
(( jobs < 1 )) && jobs=1

pids=()
for i in "${!names[@]}"; do
  name=${names[$i]}
  tree=$(tree_of "$name")
  if [[ $name != cur ]]; then
    # Extracted with fresh times (-m) into a fresh build folder: a name archived anew from another
    # commit must not meet the objects of the last call on a warm machine.
    rm -rf "$tree" "/tmp/b_$name" && mkdir -p "$tree" && tar -xmf "$ROOT/ab_$name.tar" -C "$tree"
    ln -s "$ROOT/.cutlass" "$tree/.cutlass"  # the carried headers; no .deps there: no tests are built
  fi
  mkdir -p "$OUT/build_$name"
  (
    OUT=$OUT/build_$name KERNEL_SET=custom HDIMS=$HDIMS DTYPES=$DTYPES FEATURES=none STEPS=build JOBS=$jobs \
      BUILD_DIR=/tmp/b_$name CMAKE_EXTRA="-DCUFLASH_KERNEL_REGEX=$regex -DCUFLASH_BUILD_TESTS=OFF" \
      bash "$tree/tools/gpu_check.sh" >"$OUT/build_$name.log" 2>&1
    rc=$?
    echo "$rc" >"$OUT/build_$name/rc"
    echo "$name build rc=$rc" >>"$ALL"
  ) &
  pids+=($!)
  (( i + 1 < ${#names[@]} )) && sleep "$STAGGER"
done
wait "${pids[@]}"

failed=0
for name in "${names[@]}"; do
  [[ $(cat "$OUT/build_$name/rc" 2>/dev/null) == 0 ]] || failed=1
done
for pass in $(seq 1 "$PASSES"); do
  for entry in $ENTRIES; do
    name=${entry%%:*}
    if [[ $(cat "$OUT/build_$name/rc" 2>/dev/null) != 0 ]]; then
      log "## $entry pass $pass: skipped (its build failed, $OUT/build_$name.log)"
      continue
    fi
    settings=
    [[ $entry == *:* ]] && settings=$(echo "${entry#*:}" | tr ',' ' ')
    dir=$OUT/bench_${pass}_$(printf '%s' "$entry" | md5sum | cut -c1-8)
    mkdir -p "$dir"
    # shellcheck disable=SC2086
    env $settings OUT=$dir STEPS=bench_bwd BUILD_DIR=/tmp/b_$name BENCH_BWD_ARGS="$BENCH_BWD_ARGS" \
      bash "$(tree_of "$name")/tools/gpu_check.sh" >"$dir/run.log" 2>&1
    # The benchmark's own rc, from the summary (an older tree's gpu_check does not count it in its status).
    rc=$(sed -n 's/^bench_bwd: rc=\([0-9]*\).*/\1/p' "$dir/summary.txt" 2>/dev/null | head -1)
    [[ ${rc:-1} == 0 ]] || failed=1
    log "## $entry pass $pass (bench_bwd rc=${rc:-none})"
    grep -E "^ +(64|96|128|192|256) " "$dir/bench_bwd.log" >>"$ALL" 2>/dev/null || tail -5 "$dir/run.log" >>"$ALL"
  done
done
log "gpu_trees done $(date -u +%FT%TZ)"
exit "$failed"
