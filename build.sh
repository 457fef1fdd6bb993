#!/usr/bin/env bash
# Build the patched vLLM wheel into dist/: the pinned release (pin.toml),
# patches/series applied with zero fuzz, overlay/ added, one wheel checked
# against the official one.
#   ./build.sh                 assemble: official wheel + patched files (default)
#   ./build.sh --python-only   vLLM's own python-only build (CUDA torch venv)
#   ./build.sh --from-source   vLLM's own build, compiling the CUDA kernels
#   ./build.sh --target NAME   another target: targets/NAME/pin.toml and the
#                              series it names (README, "Targets")
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

step() { printf '==> %s\n' "$*" >&2; }
overlay() { ci/overlay "${target[@]}" "$@"; }
trap 'echo "interrupted; dist/ was left as it was" >&2; exit 130' INT

. ci/prerequisites.sh
prerequisites 3 patch
step "check the checkout (pin, series, overlay)"
overlay check >&2
step "fetch and verify the official wheel"
official=$(overlay fetch-wheel)
series=$(overlay series-dir)
step "lay a fresh upstream tree"
tree=$(overlay prepare-tree)
step "apply $series/series"
tree=$(overlay apply-series "$tree")
step "copy overlay/"
tree=$(overlay copy-overlay "$tree")
step "write the provenance manifest"
tree=$(overlay stamp "$tree" --mode "$mode")
step "build the wheel ($mode)"
wheel=$(overlay build-wheel "$tree" --mode "$mode" --official "$official")
step "check the wheel against the official one"
overlay check-wheel "$wheel" --tree "$tree" --official "$official" >/dev/null
step "publish to dist/"
overlay publish "$wheel"
overlay manifest "$tree" >&2
