# Sourced by tools/branch_overlay.sh and tools/patch_overlay.sh (from the repository root):
# overlay_dir TOOL DIR prints DIR with repeated and trailing slashes dropped when it is a folder
# an overlay may be written to (removed and written anew): inside the repository, reached through
# no symlink (rm and cp would follow it, into tracked files), not inside .git, holding no tracked
# file. Otherwise it says why, as TOOL, and returns 2.
overlay_dir() {
  local tool=$1 given=$2 dir part component ok=1 tracked
  local -a parts
  dir=$(printf '%s' "$given" | tr -s '/')
  dir=${dir%/}
  case "/$dir/" in
    // | /./* | */../* | */./* | /.git/* | */.git/*) ok=0 ;;
  esac
  [[ $dir == /* ]] && ok=0
  if [[ $ok == 1 ]]; then
    part=$PWD
    IFS=/ read -ra parts <<<"$dir"
    for component in "${parts[@]}"; do
      part=$part/$component
      if [[ -L $part ]]; then ok=0; break; fi
    done
  fi
  if [[ $ok != 1 ]]; then
    echo "$tool: DIR must be a new folder inside the repository (no '..', '.git' or symlink on the way), got '$given'" >&2
    return 2
  fi
  tracked=$(git --literal-pathspecs ls-files -- "$dir") || return 2
  if [[ -n $tracked ]]; then
    echo "$tool: $dir holds tracked files; name a new folder" >&2
    return 2
  fi
  printf '%s\n' "$dir"
}
