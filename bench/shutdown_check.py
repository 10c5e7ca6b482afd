"""SIGTERM with streams in flight: `python -m bench.shutdown_check [--streams 100]
[--shutdown-timeout 5]`.

Starts `ppd serve` (the demo), opens N streaming chats (half of 40 tokens, which finish within the
timeout, half of 3000, which cannot), sends SIGTERM, and reports how each stream ended (whole with
[DONE], or an error event then [DONE], or cut), how long the server took to exit, and whether it
left anything in /tmp or /dev/shm.
"""

from __future__ import annotations

import argparse
import signal
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from bench.servers import start_server


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.shutdown_check", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--streams", type=int, default=100, help="streams in flight at SIGTERM (default: 100)"
    )
    parser.add_argument(
        "--shutdown-timeout", type=float, default=5.0, help="the server's (default: 5)"
    )
    args = parser.parse_args()
    log = Path(tempfile.mkdtemp(prefix="ppd-shutdown-check-")) / "serve.log"
    proc, url = start_server(["--shutdown-timeout", str(args.shutdown_timeout)], log)
    endings: list[str] = []

    def stream(i: int) -> None:
        body = {
            "model": "demo",
            "messages": [{"role": "user", "content": f"stream {i}"}],
            "stream": True,
            "max_tokens": 40 if i % 2 else 3000,
            "ignore_eos": True,
        }
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as resp:
                events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
            if events[-1:] != ["[DONE]"]:
                endings.append("cut")
            else:
                endings.append(
                    "error event, [DONE]"
                    if len(events) > 1 and '"error"' in events[-2]
                    else "whole, [DONE]"
                )
        except httpx.HTTPError as exc:
            endings.append(f"failed: {type(exc).__name__}")

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(args.streams)]
    for t in threads:
        t.start()
    time.sleep(3)  # every stream running
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(120)
    proc.wait(120)
    left = [
        *Path(tempfile.gettempdir()).glob(f"ppd-{proc.pid}-*"),
        *Path("/dev/shm").glob(f"ppd-{proc.pid}-*"),
    ]
    print(
        f"{args.streams} streams at SIGTERM, --shutdown-timeout {args.shutdown_timeout:g}: "
        f"{dict(Counter(endings))}; the server exited {time.monotonic() - started:.1f} s after "
        "SIGTERM "
        f"(exit status {proc.returncode}); left behind: {[str(p) for p in left] or 'nothing'}"
    )


if __name__ == "__main__":
    main()
