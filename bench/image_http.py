"""An image request the way a user sends one, against the group's own run of it: ``serve run`` of a
committed YAML, then ``POST /v1/images/generations`` in each ``output_format``; each response's
``elapsed_s`` (the group's run, loop and decode) against the client's wall time for the call.

    python -m bench.image_http --config serve_configs/qwen_image.yaml --model /tmp/qwen-image \
        --set shard_size=1 --set replicate_size=1 --size 1328x1328 --steps 8 --formats png jpeg

``--model`` points the YAML's ``model`` at the local checkpoint and ``--set FIELD=VALUE`` changes
any other field of its ``args``. The first request (which may compile a shape the YAML did not warm)
is not counted; then ``--repeats`` requests per format, one after the other, fixed seed.
"""

from __future__ import annotations

import argparse
import base64
import time
from pathlib import Path

from bench.common import ServedYaml, environment, write_results

PROMPT = "A lighthouse on a cliff at dusk, oil painting"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", type=Path, default=Path("serve_configs/qwen_image.yaml"))
    parser.add_argument("--model", required=True)
    parser.add_argument("--size", default="1328x1328")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--formats", nargs="+", default=["png", "jpeg"])
    parser.add_argument("--repeats", type=int, default=3, help="timed requests per format")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="image-http-qwen-image")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a field of the args")
    return parser


def one_request(server: ServedYaml, args, output_format: str) -> dict:
    import requests

    body = {
        "prompt": PROMPT,
        "size": args.size,
        "num_inference_steps": args.steps,
        "seed": 0,
        "output_format": output_format,
    }
    started = time.perf_counter()
    response = requests.post(f"{server.base}/v1/images/generations", json=body, headers=server.headers, timeout=1800)
    wall_s = time.perf_counter() - started
    response.raise_for_status()
    answer = response.json()
    return {
        "format": output_format,
        "wall_s": round(wall_s, 3),
        "elapsed_s": answer["elapsed_s"],
        "ratio": round(wall_s / answer["elapsed_s"], 3),
        "bytes": len(base64.b64decode(answer["data"][0]["b64_json"])),
    }


def main() -> None:
    args = build_parser().parse_args()
    server = ServedYaml(args.config, args.model, args.set, args.out, args.name)
    with server:
        first = one_request(server, args, args.formats[0])
        rows = [one_request(server, args, fmt) for fmt in args.formats for _ in range(args.repeats)]
        ready_s, phases = server.ready_s, server.phases
    env = environment()
    lines = [
        f"# Served image against the group's own run: `serve run {args.config}`",
        "",
        f"GPUs: {', '.join(env['gpus']) or 'none'}. {args.size}, {args.steps} steps, seed 0.",
        f"Command: `{env['command']}`",
        "",
        f"- server up after {ready_s:.1f} s; the group's start: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()),
        f"- first request ({first['format']}, not counted below): {first['wall_s']:.2f} s, "
        f"group {first['elapsed_s']:.2f} s",
        "",
        "| format | requests | client wall s (median) | group's elapsed_s (median) | wall / elapsed | bytes |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for fmt in args.formats:
        mine = [r for r in rows if r["format"] == fmt]
        wall = sorted(r["wall_s"] for r in mine)[len(mine) // 2]
        elapsed = sorted(r["elapsed_s"] for r in mine)[len(mine) // 2]
        ratio = wall / elapsed
        lines.append(f"| {fmt} | {len(mine)} | {wall:.3f} | {elapsed:.3f} | {ratio:.3f} | {mine[-1]['bytes']} |")
    payload = {"environment": env, "overrides": args.set, "ready_s": ready_s, "phases": phases, "first": first}
    write_results(args.out, args.name, {**payload, "rows": rows}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
