# shellcheck shell=bash
# Sourced by build.sh and ci/test.sh: check what they need before any step
# starts, naming the command that installs what is missing.
#   prerequisites GIB TOOL...   free GiB on the checkout's disk, then tools
prerequisites() {
  local need_gib=$1; shift
  local missing=() tool
  # The hints must run as pasted: root (CI, these machines) has no sudo.
  local as_root=""
  [[ $(id -u) == 0 ]] || as_root="sudo "
  for tool in "$@"; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
  done
  if ((${#missing[@]})); then
    echo "error: missing ${missing[*]} (needed by $(basename "$0"))" >&2
    echo "  next: ${as_root}apt-get install -y ${missing[*]}" >&2
    return 1
  fi
  if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "error: python3 is $(python3 -V 2>&1), the tooling needs 3.11 or newer" >&2
    echo "  next: ${as_root}apt-get install -y python3.11" >&2
    echo "  then put python3.11 first on PATH as python3" >&2
    return 1
  fi
  local free_kib
  free_kib=$(df -Pk . | awk 'NR == 2 {print $4}')
  if ((free_kib < need_gib * 1024 * 1024)); then
    echo "error: $((free_kib / 1024 / 1024)) GiB free on $(df -P . | awk 'NR == 2 {print $6}'), $(basename "$0") needs $need_gib GiB" >&2
    echo "  next: rm -rf build/tree build/pristine build/wheel build/targets/*/tree" >&2
    echo "  (scratch trees only; build/workspace may hold unexported patches, .cache/ the downloads and venvs)" >&2
    echo "  if that frees too little, free the rest outside this checkout (another clone's .cache/ and build/)" >&2
    return 1
  fi
}
