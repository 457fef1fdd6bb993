# Sourced by build.sh and ci/test.sh: check what they need before any step
# starts, naming the command that installs what is missing.
#   prerequisites GIB TOOL...   free GiB on the checkout's disk, then tools
prerequisites() {
  local need_gib=$1; shift
  local missing=() tool
  for tool in "$@"; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
  done
  if ((${#missing[@]})); then
    echo "error: missing ${missing[*]} (needed by $(basename "$0"))" >&2
    echo "  next: sudo apt-get install -y ${missing[*]}" >&2
    return 1
  fi
  if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "error: python3 is $(python3 -V 2>&1), the tooling needs 3.11 or newer" >&2
    echo "  next: sudo apt-get install -y python3.11, and put it first on PATH as python3" >&2
    return 1
  fi
  local free_kib
  free_kib=$(df -Pk . | awk 'NR == 2 {print $4}')
  if ((free_kib < need_gib * 1024 * 1024)); then
    echo "error: $((free_kib / 1024 / 1024)) GiB free on $(df -P . | awk 'NR == 2 {print $6}'), $(basename "$0") needs $need_gib GiB" >&2
    echo "  next: free disk space (\`rm -rf build\` drops the scratch trees; .cache/ holds downloads and venvs)" >&2
    return 1
  fi
}
