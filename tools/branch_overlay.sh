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
# DIR is relative to the repository root and must hold no tracked file (it is removed and
# written anew). Refused: a branch that deletes or renames files or changes a file's type (an
# overlay only adds and replaces plain files), and one whose files main has changed since the
# branch left it (the overlay would undo main's change: rebase the branch first). The folder is
# untracked; remove it before committing.
set -euo pipefail

BRANCH=${1:?usage: tools/branch_overlay.sh BRANCH DIR}
DIR=${2:?usage: tools/branch_overlay.sh BRANCH DIR}
BASE=${BASE:-main}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
DIR_GIVEN=$DIR
# DIR: a new folder inside the repository, reached through no symlink (rm and cp follow them)
# and not inside .git.
DIR=$(printf '%s' "$DIR" | tr -s '/')
DIR=${DIR%/}
case "/$DIR/" in
  //|/./* | */../* | */./* | /.git/* | */.git/*) dir_ok=0 ;;
  *) dir_ok=1 ;;
esac
if [[ $dir_ok == 1 && $DIR != /* ]]; then
  part=$ROOT
  IFS=/ read -ra parts <<<"$DIR"
  for component in "${parts[@]}"; do
    part=$part/$component
    [[ -L $part ]] && { dir_ok=0; break; }
  done
else
  dir_ok=0
fi
if [[ $dir_ok != 1 ]]; then
  echo "branch_overlay: DIR must be a new folder inside the repository (no '..', '.git' or symlink on the way), got '$DIR_GIVEN'" >&2
  exit 2
fi
tracked=$(git ls-files -- "$DIR")
if [[ -n $tracked ]]; then
  echo "branch_overlay: $DIR holds tracked files; name a new folder" >&2
  exit 2
fi

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
