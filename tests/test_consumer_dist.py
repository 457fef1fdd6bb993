"""The reference consumer's own wheel (``ci/vllm_overlay/consumer_dist.py``),
as a router installs it: into a fresh venv with pip, its dependencies from
the package index, no torch and no vLLM.

- it installs, and its console script and ``python -m`` run;
- its schema is the engine's: real batches that vLLM's real
  ``ZmqEventPublisher`` sends (every field of every event set) decode with
  the standalone schema and encode again to the same bytes, and the two
  schemas are the same msgspec schema (defaults included); a copy of the
  standalone schema with one field renamed is seen to differ;
- its CLI follows a real publisher on 127.0.0.1 (``--once``);
- it is built from the overlay file itself, reproducibly, and the build
  refuses a consumer that would import the engine.

Needs ./build.sh (the engine wheel and the consumer wheel in dist/) and the
test venv (the engine installed). The fresh venv takes about 3 s.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, built_wheel, consumer_wheel, router_venv
from overlay_harness.server_scenario import free_ports
from vllm_overlay import consumer_dist
from vllm_overlay.errors import OverlayError
from vllm_overlay.pin import load_pin
from vllm_overlay.series import load_series, source_date_epoch

CONSUMER_SOURCE = REPO.overlay / consumer_dist.CONSUMER

# Run in the fresh venv: decode the engine's payloads (hex, on stdin) with
# the standalone schema, encode them again; the schema as msgspec sees it.
ROUND_TRIP = """
import json, sys
import msgspec
from vllm_kv_events_consumer.kv_events_schema import KVEventBatch, ZMQ_END_SEQ
decoder = msgspec.msgpack.Decoder(KVEventBatch)
encoder = msgspec.msgpack.Encoder()
print(json.dumps({
    "reencoded": [
        encoder.encode(decoder.decode(bytes.fromhex(p))).hex()
        for p in json.load(sys.stdin)
    ],
    "schema": msgspec.json.schema(KVEventBatch),
    "end_seq": ZMQ_END_SEQ.hex(),
}))
"""


@pytest.fixture(scope="module")
def fresh_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new venv with only the consumer wheel, installed by pip."""
    return router_venv(tmp_path_factory.mktemp("router") / "venv")


def run(
    args: list[str], env: dict[str, str] | None = None, stdin: str = ""
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_consumer_wheel_installs_and_runs_without_torch(fresh_python: Path) -> None:
    for module in ("torch", "vllm"):
        probe = run([str(fresh_python), "-c", f"import {module}"])
        assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr
    installed = run([str(fresh_python), "-m", "pip", "list", "--format=json"])
    names = {d["name"].lower() for d in json.loads(installed.stdout)}
    assert names - {"pip", "setuptools"} == {
        "vllm-kv-events-consumer",
        "pyzmq",
        "msgspec",
    }
    script = fresh_python.parent / consumer_dist.SCRIPT
    for command, prog in (
        ([str(script)], consumer_dist.SCRIPT),
        ([str(fresh_python), "-m", consumer_dist.PACKAGE], "python -m"),
    ):
        result = run([*command, "--help"])
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"usage: {prog}"), result.stdout
        assert "--replay-endpoint" in result.stdout


def test_consumer_wheel_holds_the_overlay_file_unchanged(fresh_python: Path) -> None:
    site = run(
        [
            str(fresh_python),
            "-c",
            f"import {consumer_dist.PACKAGE}.kv_events_consumer as m; "
            "print(m.__file__)",
        ]
    )
    assert Path(site.stdout.strip()).read_bytes() == CONSUMER_SOURCE.read_bytes()


def _replay(endpoint: str, start_seq: int) -> list[tuple[int, bytes]]:
    """Every buffered batch from ``start_seq``, as the publisher sends it
    (upstream's 8-byte replay request)."""
    import zmq

    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", start_seq.to_bytes(8, "big")))
        batches = []
        while True:
            assert dealer.poll(5000), "no answer on the replay socket"
            _, _, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                return batches
            batches.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)


def _engine_events() -> list[Any]:
    """Engine structs with every field set to a value other than its default
    (fails when the engine gains a field, so that it is added here), and the
    smallest ones."""
    import msgspec
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
    )

    full_store = BlockStored(
        block_hashes=[b"\x01" * 32, 7],
        parent_block_hash=b"\x00" * 32,
        token_ids=list(range(8)),
        block_size=4,
        lora_id=3,
        medium="GPU",
        lora_name="adapter",
        extra_keys=[("adapter", ("mm", 2)), None],
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=128,
        locality="LOCAL",
        ownership="offload",
        session_id="session",
        lookahead_token_ids=[[8], [9]],
    )
    full_remove = BlockRemoved(
        block_hashes=[7],
        medium="CPU",
        group_idx=1,
        locality="REMOTE",
        ownership="offload",
    )
    for event in (full_store, full_remove):
        for field in msgspec.structs.fields(event):
            assert getattr(event, field.name) != field.default, (
                f"{type(event).__name__}.{field.name} is at its default: set it "
                "here so that the schemas are compared on it"
            )
    return [
        full_store,
        full_remove,
        BlockStored(
            block_hashes=[11],
            parent_block_hash=None,
            token_ids=[1, 2, 3, 4],
            block_size=4,
            lora_id=None,
            medium=None,
            lora_name=None,
        ),
        BlockRemoved(block_hashes=[11], medium=None),
        AllBlocksCleared(),
    ]


@pytest.fixture(scope="module")
def engine_batches() -> list[bytes]:
    """Real batches, as vLLM's real ZmqEventPublisher sends them."""
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

    live, replay = (f"tcp://127.0.0.1:{port}" for port in free_ports(2))
    publisher = ZmqEventPublisher(0, endpoint=live, replay_endpoint=replay)
    try:
        events = _engine_events()
        batches = [[e] for e in events] + [events]
        for i, batch in enumerate(batches):
            publisher.publish(KVEventBatch(ts=1000.5 + i, events=batch))
        deadline = time.monotonic() + 10
        while len(sent := _replay(replay, 0)) < len(batches):
            assert time.monotonic() < deadline, f"{len(sent)} of {len(batches)} sent"
            time.sleep(0.01)
    finally:
        publisher.shutdown()
    assert [seq for seq, _ in sent] == list(range(len(batches)))
    return [payload for _, payload in sent]


def standalone_round_trip(
    python: Path, payloads: list[bytes], pythonpath: Path | None = None
) -> dict[str, Any]:
    env = {"PYTHONPATH": str(pythonpath)} if pythonpath else {}
    result = run(
        [str(python), "-c", ROUND_TRIP],
        env=env,
        stdin=json.dumps([p.hex() for p in payloads]),
    )
    assert result.returncode == 0, result.stderr
    out: dict[str, Any] = json.loads(result.stdout)
    return out


def schema_differences(
    python: Path, payloads: list[bytes], pythonpath: Path | None = None
) -> list[str]:
    """Where the standalone schema of ``python`` reads the engine's batches
    otherwise than the engine: bytes that do not survive a decode and encode,
    a different msgspec schema (field names, types, defaults, tags), another
    end marker."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

    theirs = standalone_round_trip(python, payloads, pythonpath)
    engine = msgspec.msgpack.Decoder(KVEventBatch)
    encoder = msgspec.msgpack.Encoder()
    problems = []
    for i, payload in enumerate(payloads):
        assert encoder.encode(engine.decode(payload)) == payload
        if bytes.fromhex(theirs["reencoded"][i]) != payload:
            problems.append(f"batch {i}: the standalone schema re-encodes it otherwise")
    ours = json.loads(json.dumps(msgspec.json.schema(KVEventBatch)))
    if theirs["schema"] != ours:
        problems.append("msgspec schema differs")
    if theirs["end_seq"] != ZmqEventPublisher.END_SEQ.hex():
        problems.append("END_SEQ differs")
    return problems


def test_standalone_schema_reads_real_batches_as_the_engine(
    fresh_python: Path, engine_batches: list[bytes]
) -> None:
    assert schema_differences(fresh_python, engine_batches) == []


def test_a_changed_field_in_the_standalone_schema_is_seen(
    fresh_python: Path, engine_batches: list[bytes], tmp_path: Path
) -> None:
    """The comparison above fails when the two schemas part: a copy of the
    installed package with one BlockStored field renamed."""
    located = run(
        [
            str(fresh_python),
            "-c",
            f"import {consumer_dist.PACKAGE} as m; print(m.__file__)",
        ]
    )
    package = Path(located.stdout.strip()).parent
    copy = tmp_path / consumer_dist.PACKAGE
    shutil.copytree(package, copy)
    schema = copy / f"{consumer_dist.SCHEMA_MODULE}.py"
    text = schema.read_text()
    assert text.count("    session_id: str | None = None\n") == 1
    schema.write_text(text.replace("    session_id:", "    session:"))
    problems = schema_differences(fresh_python, engine_batches, tmp_path)
    assert "batch 0: the standalone schema re-encodes it otherwise" in problems
    assert "msgspec schema differs" in problems


def test_console_script_follows_a_real_publisher(fresh_python: Path) -> None:
    """vLLM's real publisher on 127.0.0.1: its PUB socket connects to the
    consumer's (``--bind``), its replay socket binds a free port."""
    from vllm.distributed.kv_events import (
        BlockRemoved,
        BlockStored,
        KVEventBatch,
        ZmqEventPublisher,
    )

    live, replay = (f"tcp://127.0.0.1:{port}" for port in free_ports(2))
    publisher = ZmqEventPublisher(
        0, endpoint=live, replay_endpoint=replay, copy_semantics="logical"
    )

    def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> Any:
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=4,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            group_idx=0,
        )

    try:
        for events in (
            [stored([101, 102], None, [1, 2, 3, 4, 5, 6, 7, 8])],
            [stored([103], 102, [9, 10, 11, 12])],
            [stored([201], None, [50, 51, 52, 53])],
            [BlockRemoved(block_hashes=[201], medium="GPU", group_idx=0)],
        ):
            publisher.publish(KVEventBatch(ts=time.time(), events=events))
        deadline = time.monotonic() + 10
        while len(_replay(replay, 0)) < 4:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        script = fresh_python.parent / consumer_dist.SCRIPT
        result = run(
            [
                str(script),
                "--endpoint",
                live,
                "--bind",
                "--replay-endpoint",
                replay,
                "--once",
                "--match",
                "1,2,3,4,5,6,7,8,9,10,11,12,13",
            ]
        )
    finally:
        publisher.shutdown()
    assert result.returncode == 0, result.stdout + result.stderr
    state = json.loads(result.stdout.splitlines()[-1])
    assert state["synced"] and state["snapshot_service"]
    assert state["next_seq"] == 4
    assert state["copy_semantics"] == "logical"
    assert state["tiers"] == {
        "GPU/0": {"set_keys": 3, "count_keys": 3, "count_copies": 3}
    }
    assert state["match"] == {"GPU/0": 3}


def test_consumer_wheel_is_reproducible(tmp_path: Path) -> None:
    """The wheel in dist/ is what building build/tree again gives, twice."""
    epoch = source_date_epoch(load_series(REPO.patches), load_pin(REPO.pin).source_date)
    built = [
        consumer_dist.build_consumer_wheel(
            REPO.tree, built_wheel(), tmp_path / name, epoch
        ).read_bytes()
        for name in ("a", "b")
    ]
    assert built[0] == built[1] == consumer_wheel().read_bytes()
    with zipfile.ZipFile(consumer_wheel()) as archive:
        record = archive.read(
            next(n for n in archive.namelist() if n.endswith("/RECORD"))
        ).decode()
        assert set(archive.namelist()) == {
            line.split(",")[0] for line in record.splitlines()
        }


def test_build_refuses_a_consumer_that_imports_the_engine() -> None:
    text = CONSUMER_SOURCE.read_text()
    assert consumer_dist.schema_names(text)
    broken = text.replace(
        "import msgspec\n",
        "import msgspec\nfrom vllm.config.kv_events import KVEventsCopySemantics\n",
        1,
    )
    with pytest.raises(OverlayError, match="imports vllm.config.kv_events"):
        consumer_dist.schema_names(broken)


def test_operators_guide_shows_both_ways() -> None:
    """docs/operators.md installs dist/'s consumer wheel into a venv and runs
    its command with the ports of the in-image command, which
    tests/test_doc_examples.py runs against the README's run line."""
    text = (REPO.root / "docs" / "operators.md").read_text()
    assert f"pip install dist/{consumer_dist.PACKAGE}-" in text
    image = "python -m vllm.distributed.kv_events_consumer --endpoint tcp://HOST:5557"
    standalone = f"{consumer_dist.SCRIPT} --endpoint tcp://HOST:5557"
    for command in (image, standalone):
        assert f"{command} --replay-endpoint tcp://HOST:6557" in text, command
