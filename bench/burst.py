"""What a burst looks like under ``autoscaling``: shard groups and video jobs over time.

    python -m bench.burst --device cpu --out bench/results --plot docs/burst-cpu.png

Deploys the app with ``autoscaling`` on a Ray of its own, sends ``--jobs`` video jobs over HTTP (at
once, or ``--rate`` per second; a job queued on a busy group moves to a group with a free lane after
``video_takeover_after_s``), and every ``--every`` seconds reads Serve's replicas of
the app by state (each replica is a shard group: starting, running, stopping) and the jobs by status
and group, until every job has ended and the pool is back to ``min_groups`` (or ``--deadline``).
Writes the samples (JSON), a Markdown summary (when the scale-up was decided, when the added group
ran and took its first job) and, with ``--plot``, a PNG of both over time (matplotlib). On CPU it
serves the tiny model on gloo ranks with fractional CPUs; on GPUs, ``--model`` names a checkpoint folder.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

from bench.common import environment, write_results

APP = "burst"


def _replicas() -> dict[str, int]:
    from ray import serve

    app = serve.status().applications.get(APP)
    if app is None or "HSDPServer" not in app.deployments:
        return {}
    return dict(app.deployments["HSDPServer"].replica_states)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="tiny", help="'tiny' or a checkpoint folder")
    parser.add_argument("--shard-size", type=int, default=2)
    parser.add_argument("--min-groups", type=int, default=1)
    parser.add_argument("--max-groups", type=int, default=3)
    parser.add_argument("--target-per-lane", type=float, default=2)
    parser.add_argument("--upscale-delay", type=float, default=2)
    parser.add_argument("--downscale-delay", type=float, default=20)
    parser.add_argument("--jobs", type=int, default=16)
    parser.add_argument("--rate", type=float, default=0, help="jobs sent per second; 0: all at once")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--frames", type=int, default=5)
    parser.add_argument("--size", default="64x64")
    parser.add_argument("--every", type=float, default=0.5)
    parser.add_argument("--deadline", type=float, default=300)
    parser.add_argument("--ray-cpus", type=int, default=8, help="CPU runs: logical CPUs of the local Ray")
    parser.add_argument(
        "--rank-pool-size", type=int, default=0, metavar="N",
        help="idle workers per node that imported a rank's modules (Ray's preload, as ray-hsdp serve's "
        "--rank-pool-size; -1: Ray's default count); 0: none",
    )  # fmt: skip
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--name", default="burst-cpu")
    parser.add_argument("--plot", default=None, help="write the plot to this PNG")
    return parser


def _deployment_config(args) -> dict:
    """The deployment's config: ``args``' group and its autoscaling."""
    config = {
        "model": args.model,
        "device": args.device,
        "shard_size": args.shard_size,
        "default_size": args.size,
        "max_steps": max(50, args.steps),
        "autoscaling": {
            "min_groups": args.min_groups,
            "max_groups": args.max_groups,
            "target_per_lane": args.target_per_lane,
            "upscale_delay_s": args.upscale_delay,
            "downscale_delay_s": args.downscale_delay,
            "metrics_interval_s": 0.5,
            "look_back_period_s": 2,
        },
    }
    if args.device == "cpu":
        config["cpus_per_rank"] = 0.5
    return config


def _sample(base: str, ids: list[str], jobs: dict, now: float) -> dict:
    """The groups' states and the jobs' statuses at ``now``; notes in ``jobs`` when each job was
    first seen running, on which group, and when it ended."""
    import requests

    states = _replicas()
    videos = [requests.get(f"{base}/v1/videos/{i}", timeout=30).json() for i in list(ids)]
    for video in videos:
        job = jobs.setdefault(video["id"], {"replica": None, "running_s": None, "ended_s": None})
        if video["status"] != "queued" and job["running_s"] is None:
            job["running_s"] = round(now, 2)
        job["replica"] = video.get("replica") or job["replica"]
        if video["status"] in ("completed", "failed") and job["ended_s"] is None:
            job["ended_s"] = round(now, 2)
    statuses = [video["status"] for video in videos]
    return {
        "t_s": round(now, 2),
        "groups_running": states.get("RUNNING", 0),
        "groups_starting": states.get("STARTING", 0),
        "groups_stopping": states.get("STOPPING", 0),
        **{status: statuses.count(status) for status in ("queued", "in_progress", "completed", "failed")},
    }


def main() -> None:
    args = build_parser().parse_args()

    import ray
    from ray import serve

    from bench.common import free_port
    from ray_hsdp.config.group import rank_pool_env
    from ray_hsdp.serve import build_app

    pool = rank_pool_env(None if args.rank_pool_size < 0 else args.rank_pool_size)
    os.environ.update(pool)  # the local Ray's raylet reads them at its start
    ray.init(
        address="local",
        include_dashboard=False,
        log_to_driver=False,
        num_cpus=args.ray_cpus if args.device == "cpu" else None,
    )
    port = free_port("127.0.0.1")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = _deployment_config(args)
    serve.run(build_app(config), name=APP, route_prefix=f"/{APP}")
    base = f"http://127.0.0.1:{port}/{APP}"
    ids: list[str] = []
    start = time.monotonic()
    sender = threading.Thread(target=_send, args=(base, args, ids), daemon=True)
    sender.start()
    samples, jobs = [], {}
    while True:
        now = time.monotonic() - start
        samples.append(sample := _sample(base, ids, jobs, now))
        ended = not sender.is_alive() and sample["completed"] + sample["failed"] == args.jobs
        settled = sample["groups_running"] == args.min_groups and not sample["groups_stopping"]
        if (ended and settled) or now > args.deadline:
            break
        time.sleep(args.every)
    serve.delete(APP)
    ray.shutdown()
    payload = {"config": config, "jobs": args.jobs, "rate": args.rate, "samples": samples, "job_runs": jobs}
    payload["environment"] = environment()
    write_results(Path(args.out), args.name, payload, _summary(payload, args))
    if args.plot:
        _plot(samples, args)


def _send(base: str, args, ids: list[str]) -> None:
    """Posts ``args.jobs`` video jobs, ``args.rate`` per second (all at once at rate 0)."""
    import requests

    start = time.monotonic()
    for i in range(args.jobs):
        if args.rate > 0:
            time.sleep(max(0.0, start + i / args.rate - time.monotonic()))
        body = {"prompt": f"burst {i}", "seed": i, "num_inference_steps": args.steps, "num_frames": args.frames}
        ids.append(requests.post(f"{base}/v1/videos", json=body, timeout=60).json()["id"])


def _summary(payload: dict, args) -> str:
    samples, runs = payload["samples"], payload["job_runs"]
    peak = max(s["groups_running"] for s in samples)
    decided = next((s["t_s"] for s in samples if s["groups_starting"] or s["groups_running"] > args.min_groups), None)
    added = next((s["t_s"] for s in samples if s["groups_running"] > args.min_groups), None)
    started = sorted((r["running_s"], r["replica"]) for r in runs.values() if r["running_s"] is not None)
    first_replica = started[0][1] if started else None
    added_first = next((t for t, replica in started if replica != first_replica), None)
    # The first group keeps serving while the pool grows: its jobs that ended meanwhile.
    served_meanwhile = sum(
        1
        for r in runs.values()
        if r["replica"] == first_replica
        and r["ended_s"] is not None
        and decided is not None
        and decided <= r["ended_s"] <= (added_first or float("inf"))
    )
    all_done = next((s["t_s"] for s in samples if s["completed"] + s["failed"] == args.jobs), None)
    back = next(
        (s["t_s"] for s in samples if s["t_s"] > (all_done or 0) and s["groups_running"] == args.min_groups), None
    )
    sending = "at once" if not args.rate else f"{args.rate:g} per second"

    def since(t: float | None) -> str:
        return "-" if t is None or decided is None else f"{t - decided:.1f}"

    lines = [
        f"# A burst under autoscaling: {args.jobs} video jobs sent {sending}, {args.model} on {args.device}",
        "",
        f"GPUs: {', '.join(payload['environment']['gpus']) or 'none'}",
        "",
        f"Config: `{payload['config']['autoscaling']}`, shard_size {args.shard_size}, {args.steps} steps, "
        f"{args.frames} frames at {args.size}. Times are seconds after the first job was sent, sampled "
        f"every {args.every:g} s (Serve's replica states, each job's status and group). Rank pool: "
        f"{'off' if args.rank_pool_size == 0 else 'Ray default' if args.rank_pool_size < 0 else args.rank_pool_size}"
        " (idle workers per node that preloaded a rank's modules).",
        "",
        "| what | s after the first job | s after the scale-up decision |",
        "| --- | --- | --- |",
        f"| scale-up decided (a group starting) | {_s(decided)} | 0 |",
        f"| the added group running (Serve: RUNNING) | {_s(added)} | {since(added)} |",
        f"| the added group runs its first job | {_s(added_first)} | {since(added_first)} |",
        f"| every job ended | {_s(all_done)} | |",
        f"| back to min_groups | {_s(back)} | |",
        "",
        f"Groups at most: {peak}. Jobs completed / failed: {samples[-1]['completed']} / {samples[-1]['failed']}. "
        f"Jobs the first group finished between the decision and the added group's first job: {served_meanwhile}.",
        "",
        f"Command: `{payload['environment']['command']}`",
        "",
    ]
    return "\n".join(lines)


def _s(t: float | None) -> str:
    return "-" if t is None else f"{t:.1f}"


def _plot(samples: list[dict], args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t_s"] for s in samples]
    fig, (groups, jobs) = plt.subplots(2, 1, sharex=True, figsize=(8, 5))
    groups.step(t, [s["groups_running"] for s in samples], where="post", label="running")
    groups.step(t, [s["groups_starting"] for s in samples], where="post", label="starting")
    groups.step(t, [s["groups_stopping"] for s in samples], where="post", label="stopping (draining)")
    groups.set_ylabel("shard groups")
    groups.legend(loc="upper right")
    jobs.step(t, [s["queued"] for s in samples], where="post", label="queued")
    jobs.step(t, [s["in_progress"] for s in samples], where="post", label="in progress")
    jobs.step(t, [s["completed"] for s in samples], where="post", label="completed")
    jobs.set_ylabel("video jobs")
    jobs.set_xlabel("seconds after the burst")
    jobs.legend(loc="center right")
    sending = "at once" if not args.rate else f"{args.rate:g}/s"
    fig.suptitle(f"{args.jobs} video jobs ({sending}), autoscaling {args.min_groups}..{args.max_groups} groups")
    fig.tight_layout()
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=100)


if __name__ == "__main__":
    main()
