"""The video jobs' chaos run (``test_job_chaos``), as a process of its own: its own PostgreSQL, its
own Ray (a store is one per cluster, and this one's database is stopped), the tiny two-model YAML
with its store on that database, 20 video jobs, and while they run: the store's actor killed twice
(once for good), PostgreSQL stopped for ``OUTAGE_S`` and started again, a rank of the video model's
group killed, the image model's application redeployed. Then the same 20 requests once more, with
no fault. Prints one JSON line of what it saw; the test asserts on it.

    python tests/serve/job_chaos.py OUT_FOLDER
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import requests
import yaml

sys.path[:0] = [str(Path(__file__).resolve().parents[i]) for i in (1, 2)]  # tests/ (postgres, support), bench

from postgres import postgres  # noqa: E402
from support import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
JOBS = 20
OUTAGE_S = 20.0
#: Where the run says what it is doing (the test shows its tail when the run fails or hangs).
LOG: list = []
WAITING: list = []  # the jobs not ended at the last look


def stage(what: str | None) -> None:
    if what is not None:
        LOG.append(f"{time.monotonic():.1f} {what}")
    if len(sys.argv) > 1:
        (Path(sys.argv[1]) / "stages.log").write_text("\n".join([*LOG, "not ended:", *WAITING]))


BODY = {"model": "tiny-wan", "size": "64x64", "num_frames": 5, "num_inference_steps": 6}


def deploy(config: dict) -> None:
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    _get_global_client().deploy_apps(ServeDeploySchema(**config))
    deadline = time.monotonic() + 240
    names = [app["name"] for app in config["applications"]]
    while True:
        apps = serve.status().applications
        if all(name in apps and apps[name].status == "RUNNING" for name in names):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"not running after 240 s: { {n: apps[n].status for n in names if n in apps} }")
        time.sleep(0.5)


def config_of(port: int, job_store: str, media: str, qwen_steps: int) -> dict:
    config = yaml.safe_load((ROOT / "serve_configs" / "tiny_cpu_models.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    endpoint = config["applications"][0]
    endpoint["args"].update(job_store=job_store, media_store=media, video_stale_after_s=10.0)
    config["applications"][2]["args"]["default_steps"] = qwen_steps
    return config


def wait_for(what, deadline_s: float, message: str):
    deadline = time.monotonic() + deadline_s
    while not (found := what()):
        if time.monotonic() > deadline:
            raise RuntimeError(message)
        time.sleep(0.25)
    return found


def create_all(base: str, seeds: list[int], prompt: str) -> list[str]:
    ids = []
    for seed in seeds:
        body = {**BODY, "prompt": f"{prompt} {seed}", "seed": seed}
        response = requests.post(f"{base}/v1/videos", json=body, timeout=60)
        response.raise_for_status()
        ids.append(response.json()["id"])
    return ids


def ended(base: str, ids: list[str]) -> dict | None:
    """Every job's object once each has ended, else None (what each is now goes to the stages)."""
    videos, waiting = {}, []
    for video_id in ids:
        response = requests.get(f"{base}/v1/videos/{video_id}", timeout=30)
        video = response.json() if response.status_code == 200 else {"status": response.status_code}
        videos[video_id] = video
        if video["status"] not in ("completed", "failed"):
            waiting.append(f"{video_id} {video['status']} {video.get('progress')} attempt {video.get('attempt')}")
    if waiting:
        WAITING[:] = waiting
        stage(None)
        return None
    return videos


def probe(base: str, video_id: str, stop: threading.Event, seen: list) -> None:
    """GET of one job every 0.25 s until ``stop``: the status codes the outage answers with."""
    while not stop.is_set():
        try:
            response = requests.get(f"{base}/v1/videos/{video_id}", timeout=60)  # a slow answer is no 500
            seen.append((response.status_code, response.headers.get("Retry-After")))
        except requests.RequestException as err:
            seen.append((type(err).__name__, None))
        stop.wait(0.25)


def faults(base: str, server, out: dict, config) -> None:
    import ray

    from ray_hsdp.serve.jobs.actor import find_store

    stage("kill the store (restarted)")
    ray.kill(find_store(), no_restart=False)  # 1: restarted by Ray
    ranks = requests.get(f"{base}/v1/pool", params={"model": "tiny-wan"}, timeout=30).json()["ranks"]
    stage("kill a rank")
    os.kill(ranks[1]["pid"], signal.SIGKILL)  # 2: a rank of the video model's group
    out["rank_killed"] = ranks[1]["pid"]
    stage("stop the database")
    server.stop()  # 3: the database, for OUTAGE_S
    stopped = time.monotonic()
    stage("redeploy the image model")
    deploy(config(qwen_steps=2))  # 4: the image model's application redeployed meanwhile
    stage("redeployed")
    time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - stopped)))
    server.start()
    stage("database started")
    out["outage_s"] = round(time.monotonic() - stopped, 1)
    ray.kill(find_store(), no_restart=True)  # 5: gone for good; the ingress starts it again
    stage("store killed for good")


def main(folder: Path) -> dict:
    import ray
    from ray import serve

    out: dict = {}
    with postgres() as server:
        stage("start Ray")
        ray.init(address="local", num_cpus=16, include_dashboard=False, log_to_driver=False)  # a Ray of its own
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        media = str(folder / "media")

        def config(qwen_steps: int = 3) -> dict:
            return config_of(port, server.url, media, qwen_steps)

        started = time.monotonic()
        stage("deploy")
        deploy(config())
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: requests.get(f"{base}/health", timeout=10).status_code == 200, 120, "never healthy")
        out["ready_s"] = round(time.monotonic() - started, 1)
        stage("healthy")
        seeds = list(range(100, 100 + JOBS))
        run_at = time.monotonic()
        ids = create_all(base, seeds, "a fox runs")
        stop, seen = threading.Event(), []
        prober = threading.Thread(target=probe, args=(base, ids[-1], stop, seen))
        prober.start()
        faults(base, server, out, config)
        stage("wait for the jobs")
        videos = wait_for(lambda: ended(base, ids), 120, "the jobs did not all end within 120 s after the faults")
        stop.set()
        prober.join()
        out["chaos_s"] = round(time.monotonic() - run_at, 1)
        out["probes"] = seen
        out["videos"] = videos
        stage("the lone runs")
        lone_ids = create_all(base, seeds, "a fox runs")
        lone = wait_for(lambda: ended(base, lone_ids), 120, "the lone runs did not end")
        out["lone"] = lone
        out["mp4s"] = {}
        for video_id, lone_id in zip(ids, lone_ids):
            pair = [requests.get(f"{base}/v1/videos/{v}/content", timeout=30) for v in (video_id, lone_id)]
            out["mp4s"][video_id] = [(r.status_code, r.content.hex() if r.status_code == 200 else r.text) for r in pair]
        stage("compare")
        out["files"] = sorted(p.name for p in Path(media).iterdir())
        out["total_s"] = round(time.monotonic() - started, 1)
        serve.shutdown()
        ray.shutdown()
    return out


if __name__ == "__main__":
    target = Path(sys.argv[1])
    result = main(target)
    (target / "chaos.json").write_text(json.dumps(result))
