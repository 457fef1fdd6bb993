"""A router's SUB socket, in a process of its own: ``bench_snapshot.py``'s
reader, so that the publisher's process CPU is the engine's side alone.

    python ci/bench/sub_reader.py ENDPOINT

Each line on stdin is a seq: read batches until one at or past it, then print
the last seq read. A line of -1 waits for any batch (the subscription has
landed). Exits 1, naming the last seq, if nothing comes for 10 s.
"""

from __future__ import annotations

import sys

import zmq


def main(endpoint: str) -> int:
    sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(endpoint)
    seq = -1
    for line in sys.stdin:
        target = int(line)
        while True:
            if not sub.poll(10_000):
                print(f"sub_reader: stalled after seq {seq}", file=sys.stderr)
                return 1
            seq = int.from_bytes(sub.recv_multipart()[1], "big")
            if seq >= target:
                break
        print(seq, flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} ENDPOINT")
    sys.exit(main(sys.argv[1]))
