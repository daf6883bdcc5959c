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
# touched but for DIR. DIR is relative to the repository root, reached through no symlink, not
# inside .git, and must hold no tracked file (tools/overlay_dir.sh; it is removed and written
# anew). Refused: a patch that does not apply on BASE after the ones before it; patches that
# delete or rename files, change a file's mode or add anything but plain files (an overlay only
# adds and replaces plain files); with BASE other than HEAD, patched files that HEAD has changed
# since BASE (the overlay would undo that change). The folder is untracked; remove it before
# committing.
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
  patches+=("$(realpath -- "$p")")
done
cd "$ROOT"
source "$ROOT/tools/overlay_dir.sh"
DIR=$(overlay_dir patch_overlay "$DIR") || exit 2

base=$(git rev-parse --verify --quiet "$BASE^{commit}") || { echo "patch_overlay: no commit '$BASE'" >&2; exit 2; }
scratch=$(mktemp -d)
tree=$scratch/tree
cleanup() {
  git worktree remove --force "$tree" >/dev/null 2>&1 || true
  rm -rf "$scratch"
}
trap cleanup EXIT
git -c core.hooksPath=/dev/null worktree add -q --detach "$tree" "$base"
for p in "${patches[@]}"; do
  # --index: what the patch touches is staged, ignored names included.
  if ! git -C "$tree" apply --index "$p" 2>"$scratch/err"; then
    echo "patch_overlay: $p does not apply on $BASE (after the patches before it):" >&2
    cat "$scratch/err" >&2
    exit 2
  fi
done
# Only added or modified plain files (modes 100644 / 100755) can be laid over a tree. Raw lines
# (NUL-separated): ":old_mode new_mode old_sha new_sha status", then the name.
git -C "$tree" diff --cached -z --raw --no-renames "$base" >"$scratch/raw"
refused=$(tr '\0' '\n' <"$scratch/raw" | awk '/^:/ { split(substr($0, 2), f, " "); if (f[5] !~ /^[AM]$/ || (f[2] != "100644" && f[2] != "100755") || (f[5] == "M" && f[1] != f[2])) { bad = 1; print } next } bad { print; bad = 0 }')
if [[ -n $refused ]]; then
  echo "patch_overlay: the patches delete files, change a file's type or mode, or add a link; an overlay cannot:" >&2
  echo "$refused" >&2
  exit 2
fi
git -C "$tree" diff --cached -z --name-only --no-renames "$base" >"$scratch/files"
mapfile -d '' files <"$scratch/files"
[[ ${#files[@]} -gt 0 ]] || { echo "patch_overlay: the patches change nothing on $BASE" >&2; exit 2; }
if [[ $base != $(git rev-parse HEAD) ]]; then
  # The overlay replaces the working tree's files: refuse those that HEAD changed since BASE.
  git --literal-pathspecs diff -z --name-only "$base" HEAD -- "${files[@]}" >"$scratch/moved"
  if [[ -s $scratch/moved ]]; then
    echo "patch_overlay: HEAD changed these files of the patches since $BASE:" >&2
    tr '\0' '\n' <"$scratch/moved" >&2
    exit 2
  fi
fi
rm -rf "$DIR"
for f in "${files[@]}"; do
  mkdir -p "$DIR/$(dirname "$f")"
  cp -- "$tree/$f" "$DIR/$f"
done
echo "patch_overlay: ${#files[@]} file(s) of ${#patches[@]} patch(es) under $DIR/"
