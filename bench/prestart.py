"""What Ray offers toward rank processes that have imported before they are needed (issue 74):
the time from an actor's creation in a placement group bundle to its first answer, with and
without Ray's module preload (``RAY_preload_python_modules``: each worker the raylet starts
imports them before it takes work) and with the worker pool prestarted. Each setting runs in a
Ray cluster of its own (the raylet reads the setting at its start).

    python -m bench.prestart --out bench/results/prestart-2core.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MODULES = "torch,diffusers,transformers,ray_hsdp.pipeline.sharded"

#: Settings: name -> the environment the cluster starts with.
SETTINGS = {
    "plain": {},
    "preload": {"RAY_preload_python_modules": MODULES},
    "preload + prestart": {
        "RAY_preload_python_modules": MODULES,
        "RAY_enable_worker_prestart": "1",
        "RAY_prestart_worker_first_driver": "1",
    },  # fmt: skip
}


def one_setting(actors: int, settle_s: float, gpus: int) -> dict:
    """Runs in a process of its own: a fresh cluster, then ``actors`` actors one at a time, each in
    a bundle of a placement group (with a GPU where ``gpus``), timed from creation to its answer."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray.init(num_cpus=4, num_gpus=gpus, include_dashboard=False)
    time.sleep(settle_s)  # what a node has had time to prestart before a group is asked for

    @ray.remote
    class Probe:
        def answer(self) -> dict:
            t0 = time.time()
            import diffusers  # noqa: F401 - what a rank imports first
            import torch
            import transformers  # noqa: F401

            imported = time.time()
            if torch.cuda.is_available():  # the rank's first CUDA call: its context
                torch.zeros(1, device="cuda")
            return {"at": time.time(), "imports_s": imported - t0, "cuda_s": time.time() - imported}

    bundle = {"CPU": 1, **({"GPU": 1} if gpus else {})}
    times = []
    for _ in range(actors):
        pg = placement_group([bundle])
        ray.get(pg.ready())
        start = time.time()
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg)
        probe = Probe.options(num_cpus=1, num_gpus=1 if gpus else 0, scheduling_strategy=strategy).remote()
        answer = ray.get(probe.answer.remote())
        times.append({
            "start_s": round(answer["at"] - start, 2), "imports_s": round(answer["imports_s"], 2),
            "cuda_s": round(answer["cuda_s"], 2),
        })  # fmt: skip
        ray.kill(probe)
        ray.util.remove_placement_group(pg)
    ray.shutdown()
    return {"runs": times}


def group_start(settle_s: float, gpus: int) -> dict:
    """Runs in a process of its own: a fresh cluster, then one group of one rank of the tiny model
    on the device; the start's phases (``ShardGroup.phases``)."""
    import ray

    from ray_hsdp.config.group import GroupConfig
    from ray_hsdp.group import ShardGroup

    ray.init(num_cpus=4, num_gpus=gpus, include_dashboard=False)
    time.sleep(settle_s)
    config = GroupConfig(model="tiny", device="cuda" if gpus else "cpu", shard_size=1)
    with ShardGroup(config) as group:
        phases = dict(group.phases.seconds)
    ray.shutdown()
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--actors", type=int, default=3)
    parser.add_argument("--settle-s", type=float, default=15.0)
    parser.add_argument("--gpus", type=int, default=0, help="GPUs of the cluster; each actor's bundle takes one")
    parser.add_argument("--out", default=None)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--group", action="store_true", help="a tiny group's start phases instead of probe actors")
    args = parser.parse_args()
    if args.one:
        if args.group:
            print(json.dumps(group_start(args.settle_s, args.gpus)))
        else:
            print(json.dumps(one_setting(args.actors, args.settle_s, args.gpus)))
        return
    if args.group:
        return group_starts(args)
    results = {}
    for name, env in SETTINGS.items():
        command = [sys.executable, "-m", "bench.prestart", "--one", "--actors", str(args.actors),
                   "--settle-s", str(args.settle_s), "--gpus", str(args.gpus)]  # fmt: skip
        done = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True, check=True)
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])["runs"]
        print(name, results[name], flush=True)
    lines = [
        "# Rank processes and Ray's module preload",
        "",
        f"Command: `python -m bench.prestart --actors {args.actors} --settle-s {args.settle_s:g} --gpus {args.gpus}`; "
        "an actor of 1 CPU (and 1 GPU with `--gpus`) in a placement group bundle, created after the cluster has idled "
        "the settle time; `start`: from its creation to its first answer, which imports torch, diffusers and "
        "transformers (`imports`: that import's share) and makes its CUDA context (`cuda`).",
        "",
        "| setting | start (s), each actor | imports (s), each actor | cuda (s), each actor |",
        "| --- | --- | --- | --- |",
    ]
    for name, runs in results.items():
        cells = [", ".join(f"{r[key]:.2f}" for r in runs) for key in ("start_s", "imports_s", "cuda_s")]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def group_starts(args: argparse.Namespace) -> None:
    """``--group``: the tiny group's start phases without and with the preload."""
    lines = [
        "# A group's start with Ray's module preload",
        "",
        f"Command: `python -m bench.prestart --group --settle-s {args.settle_s:g} --gpus {args.gpus}`; one group of "
        "one rank of the tiny model, each setting in a fresh cluster; seconds of the start's phases.",
        "",
    ]
    runs = {}
    for name in ("plain", "preload"):
        command = [sys.executable, "-m", "bench.prestart", "--one", "--group", "--settle-s", str(args.settle_s),
                   "--gpus", str(args.gpus)]  # fmt: skip
        done = subprocess.run(command, env={**os.environ, **SETTINGS[name]}, capture_output=True, text=True, check=True)
        runs[name] = json.loads(done.stdout.strip().splitlines()[-1])
    phases = list(runs["plain"])
    lines += ["| phase | " + " | ".join(runs) + " |", "| --- |" + " ---: |" * len(runs)]
    lines += [f"| {phase} | " + " | ".join(f"{runs[n].get(phase, 0):.2f}" for n in runs) + " |" for phase in phases]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
