"""Two models on one GPU share that holds one of them awake (issue 83), served by ``ray-hsdp serve``
as a user starts it: its phase table (from the command to ``/health`` 200), then image requests of
one model twice (the second is its warm time), the other twice, and then alternating, each of which
wakes its model while the other sleeps: each one's seconds against its model's warm time.

    python -m bench.gpu_share --model a=/tmp/wan14b-fp8 --set a.quantization=fp8 --model b=/tmp/wan14b \
        --size 832x480 --steps 4 --out bench/results

On CPU (``--device cpu``) it serves the embedded tiny models (a dry run of the steps).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench.common import environment, write_results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", action="append", required=True, metavar="NAME=FOLDER", help="a model of the share")
    parser.add_argument("--set", action="append", default=[], metavar="NAME.FIELD=VALUE", help="a model's field")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", default="832x480")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--alternations", type=int, default=3, help="rounds of one request of each model")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="gpu-share")
    return parser


def config(args) -> dict:
    """The one application ``ray-hsdp serve --config`` runs: the models, each on share ``bench``."""
    from ray_hsdp.cli.serve_flags import parse_value

    models = []
    for spec in args.model:
        name, _, folder = spec.partition("=")
        fields = {"model": folder, "model_name": name, "device": args.device, "shard_size": 1, "gpu_share": "bench",
                  "default_size": args.size, "warm_up": [], "max_steps": 50}  # fmt: skip
        for setting in args.set:
            key, _, value = setting.partition("=")
            owner, _, field = key.partition(".")
            if owner == name:
                fields[field] = parse_value(value)
        models.append(fields)
    app = {"name": "share", "route_prefix": "/", "import_path": "ray_hsdp.serve:build_app", "args": {"models": models}}
    return {"http_options": {"host": "127.0.0.1", "port": args.port}, "applications": [app]}


def request(base: str, model: str, args, seed: int) -> float:
    import requests

    body = {"model": model, "prompt": "a lighthouse at dusk", "size": args.size, "seed": seed,
            "num_inference_steps": args.steps, "output_format": "jpeg"}  # fmt: skip
    started = time.perf_counter()
    response = requests.post(f"{base}/v1/images/generations", json=body, timeout=1800)
    seconds = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"{model}: HTTP {response.status_code}: {response.text[:300]}")
    return round(seconds, 3)


def states(base: str) -> dict:
    import requests

    return requests.get(f"{base}/health", timeout=10).json().get("models", {})


def main() -> None:
    args = build_parser().parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    served = args.out / f"{args.name}.yaml"
    served.write_text(yaml.safe_dump(config(args)))
    log_path = args.out / f"{args.name}.serve.log"
    base = f"http://127.0.0.1:{args.port}"
    names = [spec.partition("=")[0] for spec in args.model]
    row: dict = {"models": names}
    with open(log_path, "w") as log:
        command = [sys.executable, "-m", "ray_hsdp.cli", "serve", "--config", str(served), "--port", str(args.port)]
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
        try:
            deadline = time.monotonic() + 1500
            while not re.search(r"^Serving ", log_path.read_text(), re.M):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"ray-hsdp serve ended or never served; see {log_path}")
                time.sleep(1)
            text = log_path.read_text()
            row["serve_phases"] = text[text.index("Ready in") : text.index("Serving ")].strip()
            row["states_at_start"] = states(base)
            warm = {}
            row["requests"] = []
            for name in names:  # each model twice in a row: the second is its warm time
                first, second = request(base, name, args, 1), request(base, name, args, 2)
                warm[name] = second
                row["requests"].append({"model": name, "first_s": first, "warm_s": second})
            row["alternating"] = []
            for round_ in range(args.alternations):
                for name in names:
                    seconds = request(base, name, args, 10 + round_)
                    over = round(seconds - warm[name], 3)
                    row["alternating"].append({"model": name, "s": seconds, "over_warm_s": over})
                    print(row["alternating"][-1], flush=True)
            row["states_at_end"] = states(base)
        except Exception as err:  # noqa: BLE001 - a failed run is a result
            row["error"] = f"{type(err).__name__}: {err}"
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=180)
            except subprocess.TimeoutExpired:
                proc.kill()
    payload = {"row": row, "config": config(args), "environment": environment(), "command": sys.argv}
    write_results(args.out, args.name, payload, table(row, args))


def table(row: dict, args) -> str:
    gpus = ", ".join(environment()["gpus"]) or "CPU"
    lines = [
        f"# Two models on one GPU share, one awake at a time ({gpus})",
        "",
        f"`ray-hsdp serve --config` of {row['models']}, images {args.size}, {args.steps} steps (JPEG).",
        "",
        row.get("serve_phases", ""),
        "",
        "| model | first s | warm s |",
        "| --- | --- | --- |",
        *[f"| {r['model']} | {r['first_s']} | {r['warm_s']} |" for r in row.get("requests", [])],
        "",
        "Alternating (each request wakes its model, the other sleeps):",
        "",
        "| model | s | over its warm time s |",
        "| --- | --- | --- |",
        *[f"| {r['model']} | {r['s']} | {r['over_warm_s']} |" for r in row.get("alternating", [])],
    ]
    if "error" in row:
        lines.append(f"\nError: {row['error']}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
