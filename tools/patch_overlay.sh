#!/usr/bin/env bash
# The files that one or more patches change (git diffs, such as bench/experiments/*.patch),
# applied in order onto a commit (BASE, default HEAD) and laid out as the repository in a folder
# of the working tree, for an overlay variant of tools/gpu_ab.sh (NAME@DIR). The patch form of
# tools/branch_overlay.sh: a change kept as a patch on main is timed against the working tree in
# one call without first making a branch of it.
#
#   tools/patch_overlay.sh ab_all bench/experiments/fwd_pv_wait_after_softmax.patch \
#       bench/experiments/fwd_o_store_row_boxes.patch
#   VARIANTS="base all@ab_all" ... tools/gpu_ab.sh
#
# The patches apply in a scratch worktree of BASE (removed at exit), so the working tree is never
# touched but for DIR. DIR is relative to the repository root and must hold no tracked file (it
# is removed and written anew). Refused: a patch that does not apply on BASE after the ones
# before it, and patches that delete or rename files or change a file's mode (an overlay only
# adds and replaces plain files). The folder is untracked; remove it before committing.
set -euo pipefail

usage="usage: tools/patch_overlay.sh DIR PATCH..."
DIR=${1:?$usage}
shift
[[ $# -gt 0 ]] || { echo "$usage" >&2; exit 2; }
BASE=${BASE:-HEAD}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
# Patches named relative to where the script was called from.
patches=()
for p in "$@"; do
  [[ -f $p ]] || { echo "patch_overlay: no patch file '$p'" >&2; exit 2; }
  patches+=("$(cd "$(dirname "$p")" && pwd)/$(basename "$p")")
done
cd "$ROOT"
DIR=${DIR%/}
if [[ -z $DIR || $DIR == . || $DIR == /* || $DIR == *..* ]]; then
  echo "patch_overlay: DIR must be a folder name inside the repository, got '$1'" >&2
  exit 2
fi
if [[ -n $(git ls-files -- "$DIR") ]]; then
  echo "patch_overlay: $DIR holds tracked files; name a new folder" >&2
  exit 2
fi

scratch=$(mktemp -d)
tree=$scratch/tree
cleanup() {
  git worktree remove --force "$tree" >/dev/null 2>&1 || true
  rm -rf "$scratch"
  git worktree prune >/dev/null 2>&1 || true
}
trap cleanup EXIT
git worktree add -q --detach "$tree" "$BASE"
for p in "${patches[@]}"; do
  if ! git -C "$tree" apply --check "$p" 2>"$scratch/err"; then
    echo "patch_overlay: $p does not apply on $BASE (after the patches before it):" >&2
    cat "$scratch/err" >&2
    exit 2
  fi
  git -C "$tree" apply "$p"
done
git -C "$tree" add -A
# NUL-separated status and names, read from files so that a failing git stops the script.
git -C "$tree" diff --cached -z --name-status --no-renames --diff-filter=DT "$BASE" >"$scratch/refused"
git -C "$tree" diff --cached --summary "$BASE" | grep -E '^ (mode change|delete mode)' >"$scratch/modes" || true
if [[ -s $scratch/refused || -s $scratch/modes ]]; then
  echo "patch_overlay: the patches delete files or change a file's type or mode; an overlay cannot:" >&2
  tr '\0' '\n' <"$scratch/refused" >&2
  cat "$scratch/modes" >&2
  exit 2
fi
git -C "$tree" diff --cached -z --name-only --no-renames "$BASE" >"$scratch/files"
mapfile -d '' files <"$scratch/files"
[[ ${#files[@]} -gt 0 ]] || { echo "patch_overlay: the patches change nothing on $BASE" >&2; exit 2; }
rm -rf "$DIR"
for f in "${files[@]}"; do
  mkdir -p "$DIR/$(dirname "$f")"
  cp -- "$tree/$f" "$DIR/$f"
done
echo "patch_overlay: ${#files[@]} file(s) of ${#patches[@]} patch(es) under $DIR/"
