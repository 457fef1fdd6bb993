"""Shared helpers for the KV-event benchmarks (stdlib + numpy; vLLM in workers).

Two sides use this module:

* the *driver* side (``run_all.py`` and each bench's ``drive``): no vLLM
  import; it launches worker processes with ``PYTHONPATH=<tree>`` and talks to
  them over stdin/stdout with JSON lines prefixed by ``RESULT_PREFIX``;
* the *worker* side (``worker_*`` functions of each bench, run inside one
  tree's process): imports vLLM from the tree named on its command line,
  checks that ``vllm.v1.core.block_pool`` really comes from that tree, and
  builds requests and block pools the way upstream's tests do.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The benches run as scripts from ci/bench; the project's modules live in ci/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from overlay_harness.cpu_scheduler import (  # noqa: E402, F401
    made_up_output,
    make_cpu_scheduler,
    step,
)
from overlay_harness.router_view import checkout_consumer  # noqa: E402

BLOCK_SIZE = 16
RESULT_PREFIX = "@@RESULT@@ "
# Label of the unpatched tree (it has no copy_semantics switch).
UPSTREAM = "upstream"


# --------------------------------------------------------------------------
# driver side
# --------------------------------------------------------------------------


def worker_env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env.setdefault("PYTHONHASHSEED", "0")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


class Worker:
    """A long-lived worker process bound to one tree (line protocol)."""

    def __init__(self, python: str, script: Path, tree: Path, args: list[str]) -> None:
        self.tree = tree
        # cwd outside every tree, so nothing shadows PYTHONPATH.
        self._cwd = tempfile.mkdtemp(prefix="kvbench-")
        self.proc = subprocess.Popen(
            [
                os.path.abspath(python),
                str(script),
                "worker",
                "--tree",
                str(tree),
                *args,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=self._cwd,
            env=worker_env(tree),
        )

    def _read_result(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(RESULT_PREFIX):
                result: dict[str, Any] = json.loads(line[len(RESULT_PREFIX) :])
                return result
        err = self.proc.stderr.read() if self.proc.stderr else ""
        raise RuntimeError(f"worker for {self.tree} died:\n{err[-4000:]}")

    def hello(self) -> dict[str, Any]:
        """The worker's first line: where vLLM was imported from."""
        self.info = self._read_result()
        return self.info

    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._read_result()

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self._cwd, ignore_errors=True)


def start_workers(
    python: str, script: Path, trees: dict[str, Path], args: list[str]
) -> tuple[dict[str, Worker], dict[str, dict[str, Any]]]:
    """Start one worker per tree (imports run in parallel); check provenance."""
    workers = {name: Worker(python, script, tree, args) for name, tree in trees.items()}
    infos: dict[str, dict[str, Any]] = {}
    try:
        for name, w in workers.items():
            info = w.hello()
            if not info.get("inside_tree"):
                raise RuntimeError(
                    f"{name}: vllm.v1.core.block_pool imported from "
                    f"{info.get('block_pool_file')}, not inside {trees[name]}"
                )
            infos[name] = info
    except BaseException:
        for w in workers.values():
            w.close()
        raise
    return workers, infos


class Session:
    """One bench's workers: its own (closed by ``close``) or shared ones.

    Shared workers (``run_all.py`` starts one per tree for all benches) get
    each command tagged with the bench's name and worker arguments.
    """

    def __init__(
        self,
        bench: str,
        python: str,
        script: Path,
        trees: dict[str, Path],
        args: list[str],
        shared: dict[str, Worker] | None = None,
    ) -> None:
        self.bench = bench
        self.args = args
        self.own = shared is None
        if shared is None:
            self.workers, self.infos = start_workers(python, script, trees, args)
        else:
            self.workers = shared
            self.infos = {name: w.info for name, w in shared.items()}

    def call(self, name: str, command: dict[str, Any]) -> dict[str, Any]:
        return self.workers[name].call(
            {**command, "bench": self.bench, "args": self.args}
        )

    def close(self) -> None:
        if self.own:
            for w in self.workers.values():
                w.close()


def emit(result: dict[str, Any]) -> None:
    """Worker side: send one result line to the driver."""
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()


def serve(tree: str, handler: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Worker main loop: provenance line, then one result per command line."""
    from vllm.envs import enable_envs_cache

    # EngineCore caches vllm.envs once it has started; without the cache every
    # envs read on the hot path (maybe_convert_block_hash, once per event
    # hash) is an os.environ lookup that no running engine pays.
    enable_envs_cache()
    emit(provenance(tree))
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("cmd") == "quit":
            return
        emit(handler(command))


def tree_of(argv: Sequence[str]) -> str:
    """The tree named by ``--tree`` on a worker's command line."""
    return argv[list(argv).index("--tree") + 1]


def cli_main(
    argv: list[str] | None,
    make_handler: Callable[[list[str]], Callable[[dict[str, Any]], dict[str, Any]]],
    drive_main: Callable[[list[str]], int],
) -> int:
    """A bench script's ``main``: ``worker ...`` serves one tree, else drive.

    The worker's handler is built from its own arguments (``make_handler``)
    before the provenance line goes out.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "worker":
        worker_argv = argv[1:]
        serve(tree_of(worker_argv), make_handler(worker_argv))
        return 0
    return drive_main(argv)


def absolute_path(arg: str) -> Path:
    return Path(arg).resolve()


def driver_parser(doc: str, **python: Any) -> argparse.ArgumentParser:
    """The driver's parser: both trees and the workers' ``--python``.

    ``python``: keywords for ``--python`` (default: this interpreter).
    """
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    # Absolute: workers run with their cwd outside every tree.
    ap.add_argument("--patched-tree", type=absolute_path, required=True)
    ap.add_argument("--unpatched-tree", type=absolute_path, required=True)
    ap.add_argument("--python", **(python or {"default": sys.executable}))
    return ap


def bench_main(
    argv: list[str] | None,
    doc: str,
    make_handler: Callable[[list[str]], Callable[[dict[str, Any]], dict[str, Any]]],
    run: Callable[[argparse.Namespace], dict[str, Any]],
    summary: Callable[[dict[str, Any]], Iterable[str]],
    add_args: Callable[[argparse.ArgumentParser], None] | None = None,
    json_help: str | None = None,
) -> int:
    """A standalone bench's ``main``: its worker, or its driver.

    The driver parses ``driver_parser``'s arguments, the bench's own
    (``add_args``), ``--quick`` and ``--json``; ``run`` drives the bench,
    ``summary`` gives the lines to print, ``--json`` gets the full result.
    """

    def drive_main(args: list[str]) -> int:
        ap = driver_parser(doc)
        if add_args is not None:
            add_args(ap)
        ap.add_argument("--quick", action="store_true")
        ap.add_argument("--json", type=Path, help=json_help)
        a = ap.parse_args(args)
        res = run(a)
        for line in summary(res):
            print(line)
        if a.json:
            a.json.write_text(json.dumps(res, indent=1))
        return 0

    return cli_main(argv, make_handler, drive_main)


def run_trees(
    session: Session, trees: dict[str, Path], log: Any
) -> dict[str, dict[str, Any]]:
    """One ``run`` command per tree, in turn; closes the session."""
    results: dict[str, dict[str, Any]] = {}
    try:
        for name in trees:
            results[name] = session.call(name, {"cmd": "run"})
            print(f"[{session.bench}] {name} done", file=log, flush=True)
    finally:
        session.close()
    return results


def block_pool_where(name: str, info: dict[str, Any]) -> str:
    """Where the ``name`` tree's worker imported the block pool from, by the
    tree's role and vLLM version (generated docs print no machine path)."""
    rel = os.path.relpath(info["block_pool_file"], info["tree"])
    where = f"`{rel}`" if info["inside_tree"] else "outside the tree (NOT its own)"
    return f"the {name} tree's {where} (vLLM {info['vllm_version']})"


def role_command(command: str, roles: dict[str, str]) -> str:
    """``command`` with each machine path named by its role: ``roles`` maps
    a path to the name a reader knows it by (``build/tree``, ``$python``);
    any other absolute path keeps its file name only."""
    import shlex

    def name(arg: str) -> str:
        if arg in roles:
            return roles[arg]
        if os.path.isabs(arg):
            return f".../{os.path.basename(arg)}"
        return arg

    return " ".join(name(a) for a in shlex.split(command))


def median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    if n == 0:
        return float("nan")
    mid = n // 2
    return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])


def percentile(xs: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``xs`` (0 < q <= 1): the smallest
    value with at least ``q`` of ``xs`` at or below it, one of the samples."""
    s = sorted(xs)
    if not s:
        return float("nan")
    return s[max(0, math.ceil(q * len(s)) - 1)]


# --------------------------------------------------------------------------
# worker side (imports vLLM lazily)
# --------------------------------------------------------------------------


def provenance(tree: str) -> dict[str, Any]:
    import vllm
    import vllm.v1.core.block_pool as bp

    root = os.path.realpath(tree)
    f = os.path.realpath(bp.__file__)
    return {
        "tree": root,
        "block_pool_file": f,
        "inside_tree": f.startswith(root + os.sep),
        "vllm_version": getattr(vllm, "__version__", "?"),
        "has_copy_semantics": has_copy_semantics(),
        "policies": policies(),
        "python": sys.version.split()[0],
    }


def has_copy_semantics() -> bool:
    import inspect

    from vllm.v1.core.block_pool import BlockPool

    return "kv_events_copy_semantics" in inspect.signature(BlockPool).parameters


def policies() -> list[str | None]:
    """The tree's copy-semantics policies; ``[None]`` on the unpatched tree."""
    if not has_copy_semantics():
        return [None]
    from vllm.config.kv_events import KV_EVENTS_COPY_SEMANTICS

    return list(KV_EVENTS_COPY_SEMANTICS)


def policy_label(policy: str | None) -> str:
    return policy if policy is not None else UPSTREAM


def make_hasher(block_size: int = BLOCK_SIZE) -> Callable[[Any], Any]:
    """vLLM's own request block hasher (as EngineCore builds it)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name("sha256")  # CacheConfig's default algorithm
    init_none_hash(hash_fn)
    return get_request_block_hasher(block_size, hash_fn)


def make_request(
    req_id: str,
    prompt: Sequence[int],
    hasher: Callable[[Any], Any],
    max_tokens: int = 17,
    eos_token_id: int = 100,
) -> Any:
    """Like upstream's ``tests/v1/core/test_prefix_caching.py::make_request``."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    params.update_from_generation_config({}, eos_token_id=eos_token_id)
    return Request(
        request_id=req_id,
        prompt_token_ids=[int(t) for t in prompt],
        sampling_params=params,
        pooling_params=None,
        block_hasher=hasher,
    )


def make_pool(
    num_blocks: int, events: bool, policy: str | None, block_size: int = BLOCK_SIZE
) -> Any:
    """A BlockPool; ``policy=None`` leaves the copy-semantics kwarg out."""
    from vllm.v1.core.block_pool import BlockPool

    kwargs: dict[str, Any] = {}
    if policy is not None:
        kwargs["kv_events_copy_semantics"] = policy
    return BlockPool(
        num_gpu_blocks=num_blocks,
        enable_caching=True,
        hash_block_size=block_size,
        enable_kv_cache_events=events,
        **kwargs,
    )


# --------------------------------------------------------------------------
# hashed workloads on a bare BlockPool (b: churn, c: duplicates)
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolWorkload:
    name: str
    num_blocks: int  # pool size
    concurrency: int  # requests holding their blocks at once
    prompts: list[list[int]]


def workload_churn(num_requests: int, seed: int = 1) -> PoolWorkload:
    """(b) random prompts (4-32 full blocks plus a partial tail), small pool."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(num_requests):
        n = int(rng.integers(4, 33)) * BLOCK_SIZE + int(rng.integers(0, BLOCK_SIZE))
        prompts.append(rng.integers(1000, 32000, size=n).tolist())
    return PoolWorkload("b_churn", num_blocks=1024, concurrency=8, prompts=prompts)


def workload_duplicates(num_requests: int, seed: int = 2) -> PoolWorkload:
    """(c) requests repeating a few block-aligned prompts (skewed popularity).

    Each repeat hits all but the last block (the last prompt token is always
    recomputed) and caches a new physical copy of the last block's key.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    families = [
        rng.integers(1000, 32000, size=int(rng.integers(4, 17)) * BLOCK_SIZE).tolist()
        for _ in range(24)
    ]
    weights = 1.0 / np.arange(1, len(families) + 1)
    weights /= weights.sum()
    picks = rng.choice(len(families), size=num_requests, p=weights)
    prompts = [families[int(i)] for i in picks]
    return PoolWorkload("c_duplicates", num_blocks=384, concurrency=16, prompts=prompts)


def build_requests(wl: PoolWorkload, hasher: Callable[[Any], Any]) -> list[Any]:
    return [make_request(f"{wl.name}-{i}", p, hasher) for i, p in enumerate(wl.prompts)]


def run_pool_workload(
    pool: Any,
    requests: Iterable[Any],
    concurrency: int,
    on_batch: Callable[[list[Any]], None] | None = None,
    on_op: Callable[[], None] | None = None,
) -> int:
    """Serve requests the way KVCacheManager drives the pool (one group).

    Per request: prefix lookup (capped at num_tokens - 1, as the manager does),
    ``touch`` the hits, ``get_new_blocks`` for the rest (evicting cached
    blocks), ``cache_full_blocks`` for the new full blocks, then drain
    ``take_events()`` (one batch per request, like one scheduler step).  At
    most ``concurrency`` requests hold blocks; the oldest is freed first
    (blocks in reverse order, as the manager frees them).  Returns the number
    of blocks allocated.
    """
    bs = BLOCK_SIZE
    active: deque[list[Any]] = deque()
    allocated = 0
    for req in requests:
        hashes = req.block_hashes
        max_hit = (req.num_tokens - 1) // bs
        hits: list[Any] = []
        for h in hashes[:max_hit]:
            got = pool.get_cached_block(h, [0])
            if got is None:
                break
            hits.append(got[0])
        pool.touch(hits)
        need = -(-req.num_tokens // bs) - len(hits)
        while pool.get_num_free_blocks() < need and active:
            pool.free_blocks(reversed(active.popleft()))
        new = pool.get_new_blocks(need)
        allocated += need
        if on_op is not None:
            on_op()
        blocks = hits + new
        pool.cache_full_blocks(req, blocks, len(hits), len(hashes), bs, 0)
        if on_op is not None:
            on_op()
        active.append(blocks)
        if len(active) > concurrency:
            pool.free_blocks(reversed(active.popleft()))
        events = pool.take_events()
        if on_batch is not None:
            on_batch(events)
    while active:
        pool.free_blocks(reversed(active.popleft()))
    return allocated


def bytecodes_executed(fn: Callable[[], object]) -> int:
    """Python bytecode instructions that ``fn()`` executes.

    Counted from ``sys.settrace`` opcode events, so the figure is the same on
    every run: a noise-free measure of interpreted work, blind to what C code
    costs inside an instruction (an allocation counts as one).
    """
    count = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "call":
            frame.f_trace_opcodes = True
        elif event == "opcode":
            count += 1
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(previous)
    return count


def resident_keys(pool: Any) -> set[Any]:
    """Keys ``(hash, group)`` with at least one resident copy in ``pool``."""
    return set(pool.cached_block_hash_to_block._cache.keys())


def copies_per_key(pool: Any) -> list[int]:
    """The number of physical copies of each key resident in ``pool``, on
    the patched and the unpatched tree alike: upstream's map (0.34.0) names
    one block id per key and lists the ids of keys with several copies in
    ``_dup_ids``, which the series keeps."""
    index = pool.cached_block_hash_to_block
    dup_ids = index._dup_ids
    return [len(dup_ids.get(key, ())) or 1 for key in index._cache]


def resident_external_keys(pool: Any) -> set[tuple[Any, int, Any]]:
    """``resident_keys`` as a router sees them in events."""
    return {external_key(k) for k in resident_keys(pool)}


def external_key(key: Any) -> tuple[Any, int, Any]:
    """A device pool's key as a router sees it in events: the reference
    consumer's (medium, group, external hash)."""
    from vllm.distributed.kv_events import MEDIUM_GPU
    from vllm.v1.core.kv_cache_utils import (
        get_block_hash,
        get_group_id,
        maybe_convert_block_hash,
    )

    return (
        MEDIUM_GPU,
        get_group_id(key),
        maybe_convert_block_hash(get_block_hash(key)),
    )


def spread(xs: Sequence[float]) -> dict[str, float]:
    """Median, min and max of ``xs`` (over seeds or repeats)."""
    return {"median": median(xs), "min": min(xs), "max": max(xs)}


def prefix_len(keys: Sequence[Any], contains: Callable[[Any], bool]) -> int:
    n = 0
    for k in keys:
        if not contains(k):
            break
        n += 1
    return n


def event_counts(events: Iterable[Any]) -> dict[str, int]:
    c = {
        "stored_events": 0,
        "stored_hashes": 0,
        "removed_events": 0,
        "removed_hashes": 0,
        "cleared_events": 0,
    }
    for ev in events:
        kind = type(ev).__name__
        if kind == "BlockStored":
            c["stored_events"] += 1
            c["stored_hashes"] += len(ev.block_hashes)
        elif kind == "BlockRemoved":
            c["removed_events"] += 1
            c["removed_hashes"] += len(ev.block_hashes)
        elif kind == "AllBlocksCleared":
            c["cleared_events"] += 1
    return c


class WireCounter:
    """Bytes as ZmqEventPublisher sends them: (topic, 8-byte seq, msgpack)."""

    def __init__(self, topic: str = "") -> None:
        import msgspec

        self._enc = msgspec.msgpack.Encoder()
        self.topic_len = len(topic.encode("utf-8"))
        self.messages = 0
        self.payload_bytes = 0
        self.frame_bytes = 0

    def add_batch(self, batch: Any) -> None:
        payload = self._enc.encode(batch)
        self.messages += 1
        self.payload_bytes += len(payload)
        self.frame_bytes += self.topic_len + 8 + len(payload)


class EventTap:
    """Stands in for ZmqEventPublisher: each batch counted, sized, mirrored.

    Every published ``KVEventBatch`` is counted (``event_counts``), sized as
    the publisher sends it (``WireCounter``) and fed to the reference
    consumer's set mirror and counting mirror (``SetMirror``,
    ``CountMirror``: keys (medium, group, hash), unknown removals recorded),
    loaded from this checkout whatever the tree, the unpatched one included.
    """

    def __init__(self) -> None:
        consumer = checkout_consumer()
        self.mirrors: dict[str, Any] = {
            "set": consumer.SetMirror(),
            "count": consumer.CountMirror(),
        }
        self.wire = WireCounter()
        self.counts = event_counts(())

    def publish(self, batch: Any) -> None:
        self.wire.add_batch(batch)
        for k, v in event_counts(batch.events).items():
            self.counts[k] += v
        for m in self.mirrors.values():
            for ev in batch.events:
                m.apply(ev)

    def shutdown(self) -> None:
        return

    def totals(self) -> dict[str, int]:
        """Event counts, messages and bytes so far."""
        return {
            **self.counts,
            "messages": self.wire.messages,
            "payload_bytes": self.wire.payload_bytes,
            "frame_bytes": self.wire.frame_bytes,
        }

    def mirror_check(
        self, truth: set[tuple[Any, int, Any]]
    ) -> dict[str, dict[str, int]]:
        """Per mirror: stale and missing keys against ``truth``, removals of
        keys it did not hold (``orphan_removals``)."""
        check = {}
        for name, m in self.mirrors.items():
            held = m.key_set()
            check[name] = {
                "stale": len(held - truth),
                "missing": len(truth - held),
                "orphan_removals": len(m.unknown_removals),
            }
        return check
