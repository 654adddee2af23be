"""`llamem serve`: how fast the page's JSON API answers an 8B estimate, beside the command line.

Rows: the API over HTTP (the first request; the same estimate again, answered from the answers the
server keeps, then computed as the CLI computes it; a new workload each request),
`llamem.cli.main` in-process, and `llamem estimate` as a subprocess (a new Python each time).
Target: an 8B estimate recompute under 100 ms (median of 50 requests).
Usage: python benchmarks/web_speed.py [--out benchmarks/results/web_speed.json]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

ARGS = ["llama-3.1-8b", "--task", "lora", "--batch", "4", "--seq", "2048"]
QUERY = "model=llama-3.1-8b&task=lora&batch=4&seq=2048"
REPEATS = 50
SUBPROCESS_RUNS = 5


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1000


def fetch(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=120) as response:
        return json.load(response)


def cli(argv: list[str]) -> None:
    from llamem.cli import main

    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0


def measure(base: str) -> list[dict]:
    rows = [{"what": "API, first request of this shape (cold caches)", "runs": 1,
             "median_ms": timed(lambda: fetch(f"{base}/api/estimate?{QUERY}"))}]
    api = [timed(lambda: fetch(f"{base}/api/estimate?{QUERY}")) for _ in range(REPEATS)]
    rows.append({"what": "API, the same estimate again (kept answer)", "runs": REPEATS,
                 "median_ms": statistics.median(api)})
    from llamem.web import routes

    kept, routes.ANSWERS_KEPT = routes.ANSWERS_KEPT, 0  # every request computed, as the CLI does
    routes._ANSWERS.clear()
    try:
        same = [timed(lambda: fetch(f"{base}/api/estimate?{QUERY}")) for _ in range(REPEATS)]
        rows.append({"what": "API, the same estimate again, computed", "runs": REPEATS,
                     "median_ms": statistics.median(same)})
        fresh = [timed(lambda i=i: fetch(f"{base}/api/estimate?{QUERY}&grad-accum={2 + i}")) for i in range(REPEATS)]
        rows.append({"what": "API, a new workload each request (grad-accum)", "runs": REPEATS,
                     "median_ms": statistics.median(fresh)})
    finally:
        routes.ANSWERS_KEPT = kept
    inproc = [timed(lambda: cli(["estimate", *ARGS, "--json"])) for _ in range(REPEATS)]
    rows.append({"what": "CLI in-process (llamem.cli.main), same estimate", "runs": REPEATS,
                 "median_ms": statistics.median(inproc)})
    command = [sys.executable, "-m", "llamem", "estimate", *ARGS, "--json"]
    sub = [timed(lambda: subprocess.run(command, check=True, capture_output=True)) for _ in range(SUBPROCESS_RUNS)]
    rows.append({"what": "CLI subprocess (llamem estimate ... --json)", "runs": SUBPROCESS_RUNS,
                 "median_ms": statistics.median(sub)})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/web_speed.json")
    args = parser.parse_args()
    from llamem.web.server import make_server

    server = make_server("127.0.0.1", 0, log=io.StringIO())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        rows = measure(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()
    print(f"llamem estimate {' '.join(ARGS)}")
    print(f"{'':<52} {'runs':>5} {'median ms':>10}")
    for row in rows:
        print(f"{row['what']:<52} {row['runs']:>5} {row['median_ms']:>10.1f}")
    computed, kept = rows[2]["median_ms"], rows[1]["median_ms"]
    print(f"target < 100 ms (median of {REPEATS}): a request asked before {kept:.1f} ms "
          f"({'met' if kept < 100 else 'NOT met'}); computed again {computed:.1f} ms "
          f"({'met' if computed < 100 else 'NOT met'}); the CLI in-process spends {rows[4]['median_ms']:.1f} ms")
    with open(args.out, "w") as handle:
        json.dump({"workload": ARGS, "rows": rows, "target_ms": 100, "kept_met": kept < 100,
                   "computed_met": computed < 100}, handle, indent=2)
        handle.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
