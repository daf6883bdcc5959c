#!/usr/bin/env bash
# The files a branch changes (against its merge base with main) laid out as the repository in a
# folder of the working tree, for an overlay variant of tools/gpu_ab.sh (NAME@DIR): a branch timed
# against the working tree in one call, without a switch in the code.
#
#   tools/branch_overlay.sh bwd-seq-clear ab_seq
#   VARIANTS="base seq@ab_seq" ... tools/gpu_ab.sh
#
# Refused: a branch that deletes or renames files (an overlay only adds and replaces), and one
# whose files main has changed since the branch left it (the overlay would undo main's change:
# rebase the branch first). The folder is untracked; remove it before committing.
set -euo pipefail

BRANCH=${1:?usage: tools/branch_overlay.sh BRANCH DIR}
DIR=${2:?usage: tools/branch_overlay.sh BRANCH DIR}
BASE=${BASE:-main}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

base=$(git merge-base "$BASE" "$BRANCH")
if [[ -n $(git diff --name-only --diff-filter=DR "$base" "$BRANCH") ]]; then
  echo "branch_overlay: $BRANCH deletes or renames files; an overlay cannot:" >&2
  git diff --name-status --diff-filter=DR "$base" "$BRANCH" >&2
  exit 2
fi
mapfile -t files < <(git diff --name-only "$base" "$BRANCH")
[[ ${#files[@]} -gt 0 ]] || { echo "branch_overlay: $BRANCH changes nothing against $BASE" >&2; exit 2; }
mapfile -t moved < <(git diff --name-only "$base" "$BASE" -- "${files[@]}")
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
