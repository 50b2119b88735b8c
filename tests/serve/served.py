"""The shipped YAMLs, deployed by the ``serve run`` CLI on a free port of 127.0.0.1: the way a user
starts the server. The serve tests share one server of the tiny YAML on the session's cluster
(``conftest.server``); ``own_ray`` runs one as on a fresh machine, with a Ray of its own."""

from __future__ import annotations

import base64
import io
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml
from PIL import Image
from support import free_port, wait_until, wait_until_healthy

ROOT = Path(__file__).resolve().parents[2]


def serve_run(tmp_path_factory, name: str = "tiny_cpu.yaml", own_ray: bool = False):
    """Generator for a fixture: yields the URL of the server of YAML ``name``, then stops it.

    Args:
        own_ray: Start it as on a fresh machine: no ``RAY_ADDRESS`` and a Ray temp folder of its
            own, so ``serve run`` starts a local Ray with this machine's real CPUs instead of
            joining the session's simulated cluster.
    """
    from ray import serve

    env = os.environ.copy()
    if own_ray:
        env.pop("RAY_ADDRESS", None)
        # Short: Ray's socket paths live under it. Without it, Ray finds the session's cluster.
        env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rh", dir="/tmp")
    else:
        serve.shutdown()  # a Serve left by an earlier test would keep its own HTTP port
    config = yaml.safe_load((ROOT / "serve_configs" / name).read_text())
    port = free_port()
    config["http_options"]["port"] = port
    path = tmp_path_factory.mktemp("serve") / name
    path.write_text(yaml.safe_dump(config))
    log = open(path.with_suffix(".log"), "w")
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("serve")), "run", str(path)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(base, proc)
    except RuntimeError as err:
        raise RuntimeError(f"{err}; serve run's log:\n{path.with_suffix('.log').read_text()[-4000:]}") from None
    yield base
    if not own_ray:
        # Serve shut down from here: a Ctrl-C'd serve run took up to 15 s more in full runs (it
        # sometimes never logged the interrupt). Its process then holds nothing.
        serve.shutdown()
        proc.kill()
    else:  # Ctrl-C: serve run shuts Serve and the local Ray it started down
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        # Seen in full runs: serve run sometimes never acts on the interrupt. Its local Ray's
        # processes share the fate of the driver, so they go with it.
        proc.kill()
        proc.wait(timeout=30)
    log.close()


def deploy(server: str, name: str, args: dict) -> str:
    """Deploys ``build_app(args)`` as app ``name`` at ``/name`` on the server's Serve; returns its URL."""
    from ray import serve

    from ray_hsdp.serve import build_app

    serve.run(build_app(args), name=name, route_prefix=f"/{name}")
    return f"{server}/{name}"


def deploy_config(server: str, applications: list[dict], timeout_s: float = 180) -> None:
    """Deploys ``applications`` as ``serve deploy`` does (Serve's controller applies a config:
    declarative), beside the shared server's own ``tiny_cpu.yaml`` applications, which the config
    carries unchanged (a declarative deploy removes the declarative applications it leaves out);
    returns once every application runs."""
    import time

    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    shared = yaml.safe_load((ROOT / "serve_configs" / "tiny_cpu.yaml").read_text())
    port = int(server.rsplit(":", 1)[1])
    config = {**shared, "http_options": {"host": "127.0.0.1", "port": port}}
    config["applications"] = shared["applications"] + applications
    _get_global_client().deploy_apps(ServeDeploySchema(**config))
    names = [app["name"] for app in config["applications"]]
    deadline = time.monotonic() + timeout_s
    while True:
        apps = serve.status().applications
        states = {name: apps[name].status if name in apps else "absent" for name in names}
        if all(state == "RUNNING" for state in states.values()):
            return
        failed = {name: apps[name].message for name, state in states.items() if state == "DEPLOY_FAILED"}
        if failed or time.monotonic() > deadline:
            raise RuntimeError(f"the applications did not all run within {timeout_s:g}s: {states} {failed}")
        time.sleep(0.5)


def decode_png(b64: str) -> Image.Image:
    """The image of a response's ``b64_json``."""
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def png_pixels(payload: dict) -> np.ndarray:
    """The first image of an images response, as float64 pixels (0-255)."""
    return np.asarray(decode_png(payload["data"][0]["b64_json"]), dtype=np.float64)


def last_step_before_it_left(steps_now, request_id: str, step: int = 0) -> int:
    """Polls ``steps_now()`` (request id -> its denoising step, of the requests a group runs now)
    until ``request_id`` leaves it; the last step it was seen at (``step`` if it never was)."""
    last = step

    def left() -> bool:
        nonlocal last
        now = steps_now()
        last = now.get(request_id, last)
        return request_id not in now

    wait_until(left, 120, f"{request_id} leaving its group", 0.05)
    return last
