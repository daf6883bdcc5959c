#!/usr/bin/env bash
# Backward benchmark of several committed trees side by side in one call (a regression hunt):
# each tree is built with its own tools/gpu_check.sh in its own folder, then bench/bench_bwd.py
# runs over the entries in alternating passes; the table lines go to $OUT/all.txt as they come.
#
#   for c in 311fc96 dee146d; do git archive -o ab_$c.tar $c; done   # on the machine with git
#   ENTRIES="cur 311fc96 dee146d cur:CUFLASH_BWD_DQ_CLEAR=memset" HDIMS="128;256" \
#   BENCH_BWD_ARGS="--hdims 128,256 --seqlens 2048 --causal 0,1 --impls cuflash,cuflash_det" tools/gpu_trees.sh
#
# ENTRIES: space-separated NAME or NAME:VAR=value[,VAR=value]; NAME is `cur` (this working tree)
# or a commit whose `git archive` is ab_NAME.tar in the repository root (an untracked file, so it
# travels with the tree). A tree is built once however many entries name it.
# HDIMS / DTYPES (default bf16): the kernels built (forward and backward of those, no tests).
# PASSES: rounds over the entries (default 2). STAGGER: seconds between the builds' starts.
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

declare -A built=()
pids=()
for entry in $ENTRIES; do
  name=${entry%%:*}
  [[ -n ${built[$name]:-} ]] && continue
  built[$name]=1
  tree=$(tree_of "$name")
  if [[ $name != cur ]]; then
    [[ -f $ROOT/ab_$name.tar ]] || { log "$name: no ab_$name.tar in the repository root"; exit 2; }
    rm -rf "$tree" && mkdir -p "$tree" && tar -xf "$ROOT/ab_$name.tar" -C "$tree"
    ln -s "$ROOT/.cutlass" "$tree/.cutlass"  # the carried headers; no .deps there: no tests are built
  fi
  mkdir -p "$OUT/build_$name"
  (
    OUT=$OUT/build_$name KERNEL_SET=custom HDIMS=$HDIMS DTYPES=$DTYPES FEATURES=none STEPS=build \
      BUILD_DIR=/tmp/b_$name CMAKE_EXTRA="-DCUFLASH_KERNEL_REGEX=$regex -DCUFLASH_BUILD_TESTS=OFF" \
      bash "$tree/tools/gpu_check.sh" >"$OUT/build_$name.log" 2>&1
    echo "$name build rc=$?" >>"$ALL"
  ) &
  pids+=($!)
  sleep "$STAGGER"
done
wait "${pids[@]}"

for pass in $(seq 1 "$PASSES"); do
  for entry in $ENTRIES; do
    name=${entry%%:*}
    settings=
    [[ $entry == *:* ]] && settings=$(echo "${entry#*:}" | tr ',' ' ')
    dir=$OUT/bench_${entry//[^A-Za-z0-9_]/_}_$pass
    mkdir -p "$dir"
    # shellcheck disable=SC2086
    env $settings OUT=$dir STEPS=bench_bwd BUILD_DIR=/tmp/b_$name BENCH_BWD_ARGS="$BENCH_BWD_ARGS" \
      bash "$(tree_of "$name")/tools/gpu_check.sh" >"$dir/run.log" 2>&1
    log "## $entry pass $pass (rc=$?)"
    grep -E "^ +(64|96|128|192|256) " "$dir/bench_bwd.log" >>"$ALL" 2>/dev/null || tail -5 "$dir/run.log" >>"$ALL"
  done
done
log "gpu_trees done $(date -u +%FT%TZ)"
