#!/usr/bin/env bash
# The test command (README): build the wheel, then on the CPU test the
# tooling, the engine fix and upstream's own tests of the patched code.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '==> %s\n' "$*" >&2; }

step "build"
./build.sh
wheel=$(ls dist/*.whl)
step "test environment with $(basename "$wheel")"
python=$(ci/overlay test-env "$wheel")
step "lint: series, DEP-3 headers, ruff"
ci/overlay lint
"$python" -m ruff check ci tests
"$python" -m ruff format --check ci tests
ci/overlay lint-upstream build/tree --python "$python"
step "project tests"
"$python" -m pytest tests
step "upstream tests on the patched tree vs the recorded baseline"
PYTHONPATH=ci "$python" -m vllm_overlay.upstream_tests check \
  --tree build/tree --python "$python" --baseline ci/upstream-baseline.json
