#!/usr/bin/env bash
# Build the patched vLLM wheel into dist/: the pinned release (pin.toml),
# patches/series applied with zero fuzz, overlay/ added, one wheel checked
# against the official one. Usage: ./build.sh [--from-source]
set -euo pipefail
cd "$(dirname "$0")"

mode=python-only
case "${1:-}" in
  "") ;;
  --from-source) mode=from-source ;;
  *) echo "usage: ./build.sh [--from-source]" >&2; exit 2 ;;
esac

step() { printf '==> %s\n' "$*" >&2; }
overlay() { ci/overlay "$@"; }

step "fetch and verify the official wheel"
official=$(overlay fetch-wheel)
step "lay a fresh upstream tree"
tree=$(overlay prepare-tree)
step "apply patches/series"
tree=$(overlay apply-series "$tree")
step "copy overlay/"
tree=$(overlay copy-overlay "$tree")
step "write the provenance manifest"
tree=$(overlay stamp "$tree" --mode "$mode")
step "bootstrap the build environment"
python=$(overlay build-env)
step "build the wheel ($mode)"
wheel=$(overlay build-wheel "$tree" --mode "$mode" --python "$python" --official "$official")
step "check the wheel against the official one"
overlay check-wheel "$wheel" --tree "$tree" --official "$official" >/dev/null
step "publish to dist/"
overlay publish "$wheel"
overlay manifest "$tree" >&2
