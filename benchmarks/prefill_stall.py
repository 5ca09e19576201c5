"""How long a streaming client of the batching server waits while another request's long prompt prefills.

Start a server first (`specsample serve --port 8111 --max-batch 4`); this streams a long greedy answer,
sends a 4,001-token prompt half a second later, and prints the longest and the median gap between the
stream's chunks, and the long request's own time. Without chunked prefill the stream stalls for the
whole prefill; with it, for one chunk (scheduler.PREFILL_CHUNK positions) at a time.

    python benchmarks/prefill_stall.py [--url http://127.0.0.1:8111]
"""

from __future__ import annotations

import argparse
import threading
import time

import httpx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8111")
    url = parser.parse_args().url
    arrivals: list[float] = []

    def stream() -> None:
        body = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", "max_tokens": 600, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
            arrivals.extend(time.perf_counter() for line in response.iter_lines() if line.startswith("data"))

    streaming = threading.Thread(target=stream)
    streaming.start()
    time.sleep(0.5)
    start = time.perf_counter()
    long = httpx.post(url + "/v1/completions", json={"prompt": "one two three four five " * 800, "max_tokens": 4,
                                                     "temperature": 0}, timeout=300)
    print(f"long prompt: status {long.status_code}, {time.perf_counter() - start:.1f} s, {long.json().get('usage')}")
    streaming.join()
    gaps = sorted(b - a for a, b in zip(arrivals, arrivals[1:]))
    print(f"stream: {len(arrivals)} chunks, longest gap {gaps[-1]:.2f} s, median gap {gaps[len(gaps) // 2]:.3f} s")


if __name__ == "__main__":
    main()
