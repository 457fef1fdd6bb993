"""``ci/bench/sub_reader.py``, the router-side reader of bench_snapshot.py,
against a real PUB socket on 127.0.0.1: it reports the first batch after its
subscription lands, reads up to each seq it is given, and exits 0 when its
stdin closes."""

from __future__ import annotations

import select
import subprocess
import sys
from pathlib import Path

import zmq

READER = Path(__file__).resolve().parents[1] / "ci" / "bench" / "sub_reader.py"


def test_reads_up_to_each_seq_it_is_given() -> None:
    pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    proc = subprocess.Popen(
        [sys.executable, str(READER), f"tcp://127.0.0.1:{port}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    seq = 0

    def send() -> None:
        nonlocal seq
        pub.send_multipart((b"", seq.to_bytes(8, "big"), b"payload"))
        seq += 1

    try:
        proc.stdin.write("-1\n")
        proc.stdin.flush()
        # A PUB drops what it sends before the subscription lands.
        while not select.select([proc.stdout], [], [], 0.05)[0]:
            send()
        first = int(proc.stdout.readline())
        assert 0 <= first < seq
        target = seq + 99
        proc.stdin.write(f"{target}\n")
        proc.stdin.flush()
        while seq <= target:
            send()
        assert int(proc.stdout.readline()) == target
        proc.stdin.close()
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        pub.close(linger=0)
