"""What a request's path through Serve costs: ``serve run`` of a YAML, then ``--requests`` small
image requests (the tiny model, 1 step, 64x64) at each ``--concurrency``, their client-side
latency's p50 and p99, and the group's own ``elapsed_s`` beside it. Run on two commits (before and
after a change of the path, such as the ingress deployment of issue 63) to compare them.

    python -m bench.hop --config serve_configs/tiny_cpu.yaml --model tiny --requests 200 --concurrency 1 8
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import ServedYaml, environment, write_results


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_at(server: ServedYaml, requests_n: int, concurrency: int, steps: int) -> dict:
    import requests

    body = {"prompt": "a hop", "size": "64x64", "num_inference_steps": steps, "seed": 1}
    session = requests.Session()

    def one(_: int) -> tuple[float, float]:
        started = time.perf_counter()
        reply = session.post(f"{server.base}/v1/images/generations", json=body, headers=server.headers, timeout=300)
        wall = time.perf_counter() - started
        reply.raise_for_status()
        return wall, reply.json()["elapsed_s"]

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(one, range(concurrency * 2)))  # not counted: connections, first calls
        began = time.perf_counter()
        results = list(pool.map(one, range(requests_n)))
        took = time.perf_counter() - began
    walls = [w for w, _ in results]
    elapsed = [e for _, e in results]
    return {
        "concurrency": concurrency,
        "requests": requests_n,
        "p50_s": round(percentile(walls, 0.5), 4),
        "p99_s": round(percentile(walls, 0.99), 4),
        "mean_s": round(statistics.mean(walls), 4),
        "group_p50_s": round(percentile(elapsed, 0.5), 4),
        "throughput_rps": round(requests_n / took, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", type=Path, default=Path("serve_configs/tiny_cpu.yaml"))
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="hop-tiny-2core")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout:
        commit += " with uncommitted changes"
    with ServedYaml(args.config, args.model, args.set, args.out, args.name) as server:
        rows = [run_at(server, args.requests, c, args.steps) for c in args.concurrency]
    for row in rows:
        print(row, flush=True)
    env = environment()
    lines = [
        f"# A request's path through Serve, commit {commit}: `serve run {args.config}`",
        "",
        f"Machine: {', '.join(env['gpus']) or 'CPU only'}; {args.requests} image requests of {args.steps} step(s) "
        f"at 64x64 per concurrency. Client latency (HTTP, through the proxy to the answer); the group's own run "
        f"(`elapsed_s`) beside it.",
        f"Command: `python -m bench.hop {' '.join(__import__('sys').argv[1:])}`",
        "",
        "| concurrency | p50 s | p99 s | mean s | group's run p50 s | requests/s |",
        "| --- | --- | --- | --- | --- | --- |",
        *(
            f"| {r['concurrency']} | {r['p50_s']} | {r['p99_s']} | {r['mean_s']} | {r['group_p50_s']} | "
            f"{r['throughput_rps']} |"
            for r in rows
        ),
    ]
    write_results(args.out, args.name, {"commit": commit, "rows": rows, "environment": env}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
