"""The simulated fleet's smoke configuration (ci/bench/bench_fleet_sim.py,
whose full matrix ci/bench.sh runs): 8 real Schedulers under cache pressure
on chat traffic where three conversations in four open with an identical
block-aligned prompt, routed by longest prefix from Dynamo's real
RadixTree used as a set. On the patched tree's stream (``logical``) the
tree predicts every request's cached prefix and rejects no event; on the
unpatched tree's it does neither. Run against the wrong trees, it fails.
The workers' Python is this one with Dynamo's runtime layered over it
(``bench_fleet.fleet_env``, made once in ``.cache/``); about 20 s of CPU,
most of it two vLLM imports."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO.root / "ci" / "bench"))
import bench_fleet_sim  # noqa: E402


def pristine_tree() -> str:
    out = subprocess.run(
        [str(REPO.root / "ci" / "overlay"), "pristine-tree"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.split()[0]


@pytest.mark.real_release
@pytest.mark.timeout(240)
def test_a_set_index_is_exact_on_our_stream_and_not_on_upstreams() -> None:
    from pathlib import Path

    res = bench_fleet_sim.smoke(
        sys.executable,
        {"patched": REPO.tree, "unpatched": Path(pristine_tree())},
        REPO.cache,
    )
    ours, upstream = res["patched"], res["unpatched"]
    assert ours["scores"]["set"]["exact"] == 1.0, ours["scores"]
    assert ours["tree_rejections"]["set"] == 0, ours["tree_rejections"]
    assert upstream["scores"]["set"]["exact"] < 1.0, upstream["scores"]
    assert upstream["tree_rejections"]["set"] > 0, upstream["tree_rejections"]
    # A counting filter is exact on either gapless stream.
    assert ours["scores"]["counting"]["exact"] == 1.0
    assert upstream["scores"]["counting"]["exact"] == 1.0
