#!/usr/bin/env bash
# The test command (README): build the wheel, then on the CPU test the
# tooling, the engine fix and upstream's own tests of the patched code.
set -euo pipefail
cd "$(dirname "$0")/.."

# When the run began: .ci/run's start, so the report counts its apt step.
started=${OVERLAY_CI_STARTED:-$(date +%s)}
cold=yes
[[ -d .cache ]] && cold=no
# Each step's start, lane and name, for build/ci-run.json (docs/testing.md,
# after "What ci/test.sh runs"); the background lane sets lane itself.
steps=build/ci-run-steps.tsv
junit=build/ci-run-project-tests.xml
walkthrough_junit=build/ci-run-walkthrough.xml
lane=main
mark() { printf '%s\t%s\t%s\n' "$(date +%s)" "$lane" "$*" >>"$steps"; }
step() {
  printf '==> %s\n' "$*" >&2
  mark "$@"
}
# The disk in use on the checkout's file system, sampled every 20 s, and
# what .cache/ holds at the end: how much free disk a run needs.
disk=build/ci-run-disk.tsv
sample_disk() { printf '%s\t%s\n' "$(date +%s)" "$(df -Pk . | awk 'NR == 2 {print $3}')" >>"$disk"; }
background=""
disk_sampler=""
# On any exit once the checks passed, a failed one too: end the main lane
# and write the report.
finish() {
  local status=$?
  mark end
  [[ -z $disk_sampler ]] || kill "$disk_sampler" 2>/dev/null || true
  sample_disk
  PYTHONPATH=ci python3 -m overlay_harness.ci_run record --steps "$steps" \
    --junit "$junit" --junit "$walkthrough_junit" --disk "$disk" --cache .cache \
    --started "$started" --cold "$cold" --status "$status" \
    --out build/ci-run.json >/dev/null ||
    echo "warning: no build/ci-run.json; the run's outcome is unchanged" >&2
  [[ -z $background ]] || rm -rf "$background"
}
# Every target: the main pin, then each targets/NAME/pin.toml (docs/build.md, "Targets").
targets=()
for pin in targets/*/pin.toml; do targets+=("$(basename "$(dirname "$pin")")"); done

# Everything the run needs, before 40 minutes of build and tests: quilt runs
# in the tests (the series must be quilt's), shellcheck in the lint step;
# build.sh checks the rest again. The free disk a cold run needs, and what
# it leaves in .cache/, are measured in docs/testing.md: short of that it
# would stop halfway, with every later test failing on "No space left on
# device".
need_gib=40
[[ $cold == no ]] && need_gib=20
. ci/prerequisites.sh
prerequisites "$need_gib" quilt patch git shellcheck nodejs npm
mkdir -p build
: >"$steps"
rm -f "$junit" "$walkthrough_junit" build/ci-run.json
: >"$disk"
trap finish EXIT
# Stops with this script, also when it is killed before finish can run.
(while kill -0 $$ 2>/dev/null; do
  sample_disk
  sleep 20
done) >/dev/null 2>&1 &
disk_sampler=$!

# Every check that needs no build, first: a typo fails in seconds.
step "lint: series, DEP-3 headers, versions, doc links, ruff, mypy, shellcheck"
ci/overlay lint
step "build"
./build.sh
for t in "${targets[@]}"; do
  step "build --target $t"
  ./build.sh --target "$t"
done
wheel=$(ls dist/vllm-*.whl)
step "test environment with $(basename "$wheel")"
python=$(PYTHONPATH=ci python3 -m overlay_harness.testenv "$wheel")
step "lint against the builds: mypy on the harness and benchmarks, ruff on upstream's files"
# the harness and benchmarks against the engine they drive
"$python" -m mypy
# upstream files: in a venv with only the ruff upstream pins (.cache/ruff-env-*)
ci/overlay lint-upstream build/tree
for t in "${targets[@]}"; do
  ci/overlay --target "$t" lint-upstream "build/targets/$t/tree"
done
# Upstream's tests (two pytest workers), the maintainer guide's walkthrough
# (the longest project test module) and the benchmark smoke run beside the
# other project tests, whose servers, builds and downloads leave a core idle
# for much of their run; their log is printed once both lanes are done.
background=$(mktemp -d)
step "in the background: upstream tests and the overlay's new tests, the walkthrough, the benchmark smoke"
mapfile -t new_tests < <(cd overlay && find tests -name 'test_*.py' | sort)
(
  set -e
  lane=background
  step "upstream tests and the overlay's new tests, vs the unpatched baseline"
  PYTHONPATH=ci "$python" -m overlay_harness.upstream_tests check -q \
    --tree build/tree --python "$python" --baseline ci/upstream-baseline.json \
    --extra "${new_tests[@]}" --expected ci/overlay-tests.txt
  step "project tests: tests/test_walkthrough.py"
  "$python" -m pytest tests/test_walkthrough.py --junitxml "$walkthrough_junit"
  step "benchmark smoke: ci/bench/run_all.py --quick (figures not checked)"
  mkdir "$background/smoke"
  "$python" ci/bench/run_all.py --quick --patched-tree build/tree \
    --unpatched-tree "$(ci/overlay pristine-tree)" --python "$python" \
    --out "$background/smoke" >/dev/null
  mark end
) >"$background/log" 2>&1 &
upstream_step=$!
step "project tests but the walkthrough"
project_status=0
"$python" -m pytest tests --ignore tests/test_walkthrough.py --junitxml "$junit" ||
  project_status=$?
upstream_status=0
wait "$upstream_step" || upstream_status=$?
step "the background steps' log"
cat "$background/log"
if ((project_status || upstream_status)); then
  echo "error: project tests exited $project_status, the background steps" \
    "$upstream_status; each log is above" >&2
  exit 1
fi
