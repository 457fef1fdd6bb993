#!/usr/bin/env bash
# Build the patched vLLM wheel into dist/: the pinned release (pin.toml),
# patches/series applied with zero fuzz, overlay/ added, one wheel checked
# against the official one. The steps (each prints a "==>" line) are
# `ci/overlay build` (ci/vllm_overlay/__main__.py, cmd_build), one process.
#   ./build.sh                 assemble: official wheel + patched files (default)
#   ./build.sh --python-only   vLLM's own python-only build (CUDA torch venv)
#   ./build.sh --from-source   vLLM's own build, compiling the CUDA kernels
#   ./build.sh --target NAME   another target: targets/NAME/pin.toml and the
#                              series it names (docs/build.md, "Targets")
set -euo pipefail
cd "$(dirname "$0")"

usage="usage: ./build.sh [--python-only | --from-source] [--target NAME]"
mode=assemble
target=()
while (($#)); do
  case "$1" in
    --python-only) mode=python-only ;;
    --from-source) mode=from-source ;;
    --target)
      [[ $# -ge 2 && -n $2 ]] || { echo "$usage" >&2; exit 2; }
      target=(--target "$2"); shift ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
  shift
done

trap 'echo "interrupted; dist/ was left as it was" >&2; exit 130' INT

. ci/prerequisites.sh
prerequisites 3 patch
ci/overlay "${target[@]}" build --mode "$mode"
