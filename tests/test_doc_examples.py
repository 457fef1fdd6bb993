"""The docs' router-facing examples against the real engine code.

* Every consumer command line in docs/operators.md and
  docs/snapshot-protocol.md uses the ports the README's run line publishes,
  and runs as printed (HOST made 127.0.0.1, ``--once`` added) against a real
  ``ZmqEventPublisher`` bound as that run line binds it.
* The payload schema in docs/snapshot-protocol.md is what ``schema_markdown``
  renders from the real msgspec structs, and the status map's keys are the
  ones a real publisher sends.
* ``GET /kv_event_sources``'s fields, as docs/operators.md lists them, are
  the engine's ``KVEventsConfig``'s.

They need the test venv (vLLM importable), as tests/test_docs.py does."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
import typing

import msgspec
import zmq

from conftest import REPO

ROOT = REPO.root
CONSUMER = "python -m vllm.distributed.kv_events_consumer"
SCHEMA_BEGIN = "<!-- payload schema: generated, see tests/test_doc_examples.py -->"
SCHEMA_END = "<!-- end of payload schema -->"


def run_line_ports() -> tuple[int, int]:
    """The PUB and replay ports the README's run line configures, checked
    against what it publishes on the host."""
    readme = (ROOT / "README.md").read_text()
    config = json.loads(re.search(r"--kv-events-config '([^']+)'", readme)[1])
    ports = []
    for key in ("endpoint", "replay_endpoint"):
        m = re.fullmatch(r"tcp://\*:(\d+)", config[key])
        assert m, f"the run line's {key} is not a tcp wildcard: {config[key]}"
        port = int(m[1])
        assert f"-p 127.0.0.1:{port}:{port}" in readme, f"port {port} not published"
        ports.append(port)
    return ports[0], ports[1]


def consumer_commands() -> list[tuple[str, list[str]]]:
    """Every consumer command line of the two guides, as argv."""
    found = []
    for rel in ("docs/operators.md", "docs/snapshot-protocol.md"):
        text = " ".join((ROOT / rel).read_text().split())
        for m in re.finditer(re.escape(CONSUMER) + r"(?: [^`]*)?`", text):
            line = m[0].rstrip("`")
            if "--endpoint" in line:
                found.append((rel, shlex.split(line)))
    return found


def test_consumer_examples_use_the_run_lines_ports_and_run():
    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

    pub_port, replay_port = run_line_ports()
    commands = consumer_commands()
    assert {rel for rel, _ in commands} == {
        "docs/operators.md",
        "docs/snapshot-protocol.md",
    }
    for rel, argv in commands:
        args = dict(zip(argv[3::2], argv[4::2], strict=True))
        assert args["--endpoint"] == f"tcp://HOST:{pub_port}", rel
        assert args["--replay-endpoint"] == f"tcp://HOST:{replay_port}", rel

    # Bound as the run line binds it (wildcards, the same ports).
    publisher = None
    for _ in range(50):
        try:
            publisher = ZmqEventPublisher(
                0,
                endpoint=f"tcp://*:{pub_port}",
                replay_endpoint=f"tcp://*:{replay_port}",
            )
            break
        except zmq.ZMQError:
            time.sleep(0.1)
    assert publisher is not None, f"ports {pub_port}, {replay_port} stayed in use"
    try:
        publisher.publish(
            KVEventBatch(
                ts=0.0,
                events=[
                    BlockStored(
                        block_hashes=[11],
                        parent_block_hash=None,
                        token_ids=[1, 2, 3, 4],
                        block_size=4,
                        lora_id=None,
                        medium="GPU",
                        lora_name=None,
                        group_idx=0,
                    )
                ],
            )
        )
        for rel, argv in commands:
            cmd = [sys.executable, *argv[1:], "--once"]
            cmd = [a.replace("HOST", "127.0.0.1") for a in cmd]
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=120, check=False
            )
            assert proc.returncode == 0, (rel, cmd, proc.stdout, proc.stderr)
            state = json.loads(proc.stdout.splitlines()[-1])
            assert state["synced"] and state["next_seq"] == 1, (rel, state)
            assert state["tiers"]["GPU/0"]["set_keys"] == 1, (rel, state)
    finally:
        publisher.shutdown()


def _type_name(tp: object) -> str:
    text = tp.__name__ if isinstance(tp, type) else str(tp)
    text = re.sub(r"\b(?:vllm\.[\w.]+|typing)\.", "", text)
    # A bar inside a table cell is escaped, code span or not.
    return text.replace("NoneType", "None").replace(" | ", " \\| ")


def _fields_table(cls: type) -> list[str]:
    rows = ["| # | field | type | default |", "|---|---|---|---|"]
    for i, f in enumerate(msgspec.structs.fields(cls)):
        default = "required" if f.default is msgspec.NODEFAULT else f"`{f.default!r}`"
        rows.append(f"| {i} | `{f.encode_name}` | `{_type_name(f.type)}` | {default} |")
    return rows


def schema_markdown() -> str:
    """The payload schema section of docs/snapshot-protocol.md, rendered from
    vLLM's msgspec structs."""
    from vllm.distributed import kv_events as k

    batch = k.KVEventBatch.__struct_config__
    assert batch.array_like, "KVEventBatch is no longer an array"
    events = (k.BlockStored, k.BlockRemoved, k.AllBlocksCleared)
    tag_field = {e.__struct_config__.tag_field for e in events}
    assert len(tag_field) == 1
    (tag,) = tag_field
    omit = {e.__struct_config__.omit_defaults for e in events}
    lines = [
        SCHEMA_BEGIN,
        "",
        "Every `payload` (live, replayed or in a snapshot) is one msgpack",
        "`KVEventBatch`, encoded as an **array** of its fields in this order"
        + (
            " (read a missing trailing field as its default):"
            if batch.omit_defaults
            else ":"
        ),
        "",
        *_fields_table(k.KVEventBatch),
        "",
        f"`events` is an array of events. Each event is a msgpack **map** with "
        f'string keys, tagged by its `"{tag}"` key: '
        + ", ".join(f'`"{e.__struct_config__.tag}"`' for e in events)
        + "."
        + (
            " A field equal to its default is left out of the map: read a "
            "missing key as its default, and ignore keys you do not know."
            if omit == {True}
            else ""
        ),
        "Hashes are msgpack ints (or bytes from engines that hash to bytes).",
    ]
    for event in events:
        lines += [
            "",
            f'`{event.__name__}` (`"{tag}": "{event.__struct_config__.tag}"`):',
            "",
        ]
        fields = _fields_table(event)
        lines += fields if len(fields) > 2 else ["no other field."]
    lines += ["", SCHEMA_END]
    return "\n".join(lines)


def test_payload_schema_is_the_structs():
    doc = (ROOT / "docs" / "snapshot-protocol.md").read_text()
    start, end = doc.find(SCHEMA_BEGIN), doc.find(SCHEMA_END)
    assert 0 <= start < end, "the payload schema section is missing"
    written = doc[start : end + len(SCHEMA_END)]
    assert written == schema_markdown(), (
        "docs/snapshot-protocol.md's payload schema differs from the structs; "
        "paste the output of: PYTHONPATH=tests:ci PY -c 'import "
        "test_doc_examples as t; print(t.schema_markdown())'"
    )


def test_status_keys_are_the_documented_ones(monkeypatch):
    from vllm.distributed.kv_events import ZmqEventPublisher

    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    doc = " ".join((ROOT / "docs" / "snapshot-protocol.md").read_text().split())
    row = re.search(r'\| `\{"op": "status"\}` \| none \| ([^|]+) \|', doc)[1]
    documented = set(re.findall(r"`(\w+)(?::|`)", row))
    documented |= set(re.findall(r"\{([^}]+)\}", row)[0].replace(",", " ").split())
    pub = ZmqEventPublisher(0, endpoint="tcp://*:0", replay_endpoint="tcp://*:0")
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        dealer.connect(pub.get_publisher_config().replay_endpoint)
        dealer.send_multipart([b"", msgspec.msgpack.encode({"op": "status"})])
        assert dealer.poll(5000)
        info = msgspec.msgpack.decode(dealer.recv_multipart()[-1])
    finally:
        dealer.close(linger=0)
        pub.shutdown()
    sent = set(info) - {"status", "epoch"} | set(info["snapshot"])
    assert documented == sent


def test_kv_event_sources_fields_are_the_config():
    from vllm.config.kv_events import KVEventsConfig

    doc = " ".join((ROOT / "docs" / "operators.md").read_text().split())
    m = re.search(r"`GET /kv_event_sources` returns .*? fields: ([^.]+)\.", doc)
    assert m, "docs/operators.md does not describe /kv_event_sources"
    documented = re.findall(r"`(\w+)`", m[1])
    fields = list(typing.get_type_hints(KVEventsConfig))
    assert documented == [f for f in fields if not f.startswith("_")]
