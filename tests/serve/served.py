"""The shipped tiny YAML, deployed by the ``serve run`` CLI on a free port of 127.0.0.1: the way a
user starts the server. Each test module that needs it gets its own."""

from __future__ import annotations

import base64
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml
from conftest import free_port, wait_until_healthy
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]


def serve_run(tmp_path_factory, name: str = "tiny_cpu.yaml"):
    """Generator for a module fixture: yields the URL of the server of YAML ``name``, then stops it."""
    from ray import serve

    serve.shutdown()  # a Serve left by an earlier test (a notebook's) would keep its own HTTP port
    config = yaml.safe_load((ROOT / "serve_configs" / name).read_text())
    port = free_port()
    config["http_options"]["port"] = port
    path = tmp_path_factory.mktemp("serve") / name
    path.write_text(yaml.safe_dump(config))
    log = open(path.with_suffix(".log"), "w")
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("serve")), "run", str(path)],
        cwd=ROOT,
        env=os.environ.copy(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(base, proc)
    except RuntimeError as err:
        raise RuntimeError(f"{err}; serve run's log:\n{path.with_suffix('.log').read_text()[-4000:]}") from None
    yield base
    proc.send_signal(signal.SIGINT)  # serve run shuts Serve down on Ctrl-C
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        # Seen in full runs: it sometimes never logs the interrupt; Serve is shut down below anyway.
        proc.kill()
    serve.shutdown()
    log.close()


def decode_png(b64: str) -> Image.Image:
    """The image of a response's ``b64_json``."""
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def png_pixels(payload: dict) -> np.ndarray:
    """The first image of an images response, as float64 pixels (0-255)."""
    return np.asarray(decode_png(payload["data"][0]["b64_json"]), dtype=np.float64)
