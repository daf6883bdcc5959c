#!/usr/bin/env bash
# The files a branch changes (against its merge base with main) laid out as the repository in a
# folder of the working tree, for an overlay variant of tools/gpu_ab.sh (NAME@DIR): a branch timed
# against the working tree in one call, without a switch in the code. gpu_ab.sh lays the folder
# over a copy of the working tree as it is (uncommitted edits included), so the overlay replaces
# whatever the tree holds in those files.
#
#   tools/branch_overlay.sh bwd-seq-clear ab_seq
#   VARIANTS="base seq@ab_seq" ... tools/gpu_ab.sh
#
# DIR is relative to the repository root, reached through no symlink, not inside .git, and must
# hold no tracked file (tools/overlay_dir.sh; it is removed and written anew). Refused: a branch
# that deletes or renames files or changes a file's type (an overlay only adds and replaces plain
# files), and one whose files main has changed since the branch left it (the overlay would undo
# main's change: rebase the branch first). The folder is untracked; remove it before committing.
set -euo pipefail

BRANCH=${1:?usage: tools/branch_overlay.sh BRANCH DIR}
DIR=${2:?usage: tools/branch_overlay.sh BRANCH DIR}
BASE=${BASE:-main}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
source "$ROOT/tools/overlay_dir.sh"
DIR=$(overlay_dir branch_overlay "$DIR") || exit 2

base=$(git merge-base "$BASE" "$BRANCH")
changes=$(git diff --name-status --diff-filter=DRT "$base" "$BRANCH")
if [[ -n $changes ]]; then
  echo "branch_overlay: $BRANCH deletes, renames or retypes files; an overlay cannot:" >&2
  echo "$changes" >&2
  exit 2
fi
# NUL-separated names (no quoting of unusual bytes), read from files so that a failing git stops
# the script; literal pathspecs so that no name is taken for a pattern.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
git diff -z --name-only "$base" "$BRANCH" >"$scratch/files"
mapfile -d '' files <"$scratch/files"
[[ ${#files[@]} -gt 0 ]] || { echo "branch_overlay: $BRANCH changes nothing against $BASE" >&2; exit 2; }
git --literal-pathspecs diff -z --name-only "$base" "$BASE" -- "${files[@]}" >"$scratch/moved"
mapfile -d '' moved <"$scratch/moved"
if [[ ${#moved[@]} -gt 0 ]]; then
  echo "branch_overlay: $BASE changed these files of $BRANCH since it left; rebase $BRANCH first:" >&2
  printf '  %s\n' "${moved[@]}" >&2
  exit 2
fi
rm -rf "$DIR"
for f in "${files[@]}"; do
  mkdir -p "$DIR/$(dirname "$f")"
  git show "$BRANCH:$f" >"$DIR/$f"
done
echo "branch_overlay: ${#files[@]} file(s) of $BRANCH under $DIR/"
