"""Fingerprints of what a user sees for fixed seeds: ``make demo``'s images and video, and every
shipped CPU YAML's answers under plain ``serve run``. A refactor that changes no behaviour leaves
them equal; run it on the commit before and the commit after and compare the two files.

    python -m bench.outputs --out /tmp/after.json
    python -m bench.outputs --compare /tmp/before.json /tmp/after.json

Each fingerprint is the SHA-256 of the decoded pixels (PNG) or frames (MP4, decoded with PyAV),
with their mean, so that a difference shows how large it is.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from bench.common import free_port, stop_server

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

#: What is asked of each shipped CPU YAML: (route prefix, endpoint, body), fixed seeds.
REQUESTS = {
    "tiny_cpu.yaml": [
        ("/", "images", {"prompt": "A cat bakes a cake", "size": "64x64", "seed": 1}),
        ("/", "images", {"prompt": "A cat bakes a cake", "size": "64x64", "seed": 2, "lora": "style:0.5,detail"}),
        ("/", "video", {"prompt": "A red fox runs", "size": "64x64", "num_frames": "9", "seed": "4"}),
        ("/i2v", "video", {"prompt": "The cat waves", "size": "64x64", "num_frames": "9", "seed": "3", "image": 5}),
    ],
    "tiny_cpu_usp.yaml": [
        ("/", "images", {"prompt": "A cat bakes a cake", "size": "64x64", "seed": 1}),
        ("/", "images", {"prompt": "A dog reads", "size": "64x64", "seed": 7, "num_inference_steps": 3}),
    ],
}


def fingerprint(pixels: np.ndarray) -> dict:
    return {"sha256": hashlib.sha256(np.ascontiguousarray(pixels).tobytes()).hexdigest(), "mean": float(pixels.mean())}


def png_pixels(data: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def mp4_frames(data: bytes) -> np.ndarray:
    from ray_hsdp.serve.media import decode_mp4

    return decode_mp4(data)[0]


def _ask(base: str, endpoint: str, body: dict) -> np.ndarray:
    import requests

    if endpoint == "images":
        answer = requests.post(f"{base}/v1/images/generations", json=body, timeout=300)
        answer.raise_for_status()
        return png_pixels(base64.b64decode(answer.json()["data"][0]["b64_json"]))
    from bench.reference import random_png

    form = {k: v for k, v in body.items() if k != "image"}
    files = None
    if "image" in body:
        files = {"input_reference": ("first.png", random_png(64, 64, body["image"]), "image/png")}
    answer = requests.post(f"{base}/v1/videos/sync", data=form, files=files, timeout=300)
    answer.raise_for_status()
    return mp4_frames(answer.content)


def yaml_outputs(name: str, workdir: Path) -> dict:
    """Starts ``serve run`` on the YAML (a Ray of its own, a free port), asks its requests, stops it."""
    import requests

    config = yaml.safe_load((ROOT / "serve_configs" / name).read_text())
    port = free_port("127.0.0.1")
    config["http_options"]["port"] = port
    path = workdir / name
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rh", dir="/tmp")
    with open(path.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen([str(BIN / "serve"), "run", str(path)], cwd=ROOT, env=env, stdout=log, stderr=log)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    if all(
                        requests.get(f"{base}{prefix.rstrip('/')}/health", timeout=5).status_code == 200
                        for prefix, _, _ in REQUESTS[name]
                    ):
                        break
                except requests.RequestException:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not come up; log: {path.with_suffix('.log')}")
                time.sleep(1)
            out = {}
            for i, (prefix, endpoint, body) in enumerate(REQUESTS[name]):
                out[f"{i} {prefix} {endpoint} {json.dumps(body, sort_keys=True)}"] = fingerprint(
                    _ask(f"{base}{prefix.rstrip('/')}", endpoint, body)
                )
            return out
        finally:
            stop_server(proc)


def demo_outputs(workdir: Path) -> dict:
    """``ray-hsdp demo`` (what ``make demo`` runs) with its defaults; its two images and its video."""
    out = workdir / "demo.png"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rh", dir="/tmp")
    subprocess.run([str(BIN / "ray-hsdp"), "demo", "--out", str(out)], cwd=ROOT, env=env, check=True, timeout=900)
    files = sorted(workdir.glob("demo*.png")) + [out.with_suffix(".mp4")]
    return {
        f.name: fingerprint(png_pixels(f.read_bytes()) if f.suffix == ".png" else mp4_frames(f.read_bytes()))
        for f in files
    }


def compare(before: dict, after: dict) -> int:
    differ = 0
    for source in sorted(set(before) | set(after)):
        for key in sorted(set(before.get(source, {})) | set(after.get(source, {}))):
            a, b = before.get(source, {}).get(key), after.get(source, {}).get(key)
            same = a is not None and b is not None and a["sha256"] == b["sha256"]
            differ += not same
            print(f"{'same' if same else 'DIFFERS'}  {source}: {key}  {a and a['mean']:.4} / {b and b['mean']:.4}")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the fingerprints here (JSON)")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two fingerprint files")
    args = parser.parse_args()
    if args.compare:
        before, after = (json.loads(Path(p).read_text()) for p in args.compare)
        return compare(before["outputs"], after["outputs"])
    workdir = Path(tempfile.mkdtemp(prefix="outputs-"))
    outputs = {"make demo": demo_outputs(workdir)}
    for name in REQUESTS:
        outputs[name] = yaml_outputs(name, workdir)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    Path(args.out).write_text(json.dumps({"commit": commit, "outputs": outputs}, indent=1))
    print(json.dumps(outputs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
