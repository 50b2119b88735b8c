"""Where a rank's "rank processes and imports" goes before it reads a weight: Ray starting a worker
process, the worker's own start, and each import a rank makes, timed in a fresh actor.

    python -m bench.actor_start --model-dir /tmp/wan14b-fp8 --repeats 3 --out bench/results

Each repeat creates one actor as a group creates a rank (a GPU where there is one, in a placement
group bundle) and splits the time from ``.remote()`` to its first answer into: until the worker's
process existed (Ray's worker pool: fork/exec), the process's start to the actor's ``__init__``
(the interpreter, ``import ray``, registering with the raylet, unpickling the class), then in the
actor: ``import torch``, the CUDA context, the model folder's component classes (diffusers,
transformers) and ``ray_hsdp.pipeline.sharded``, in the order a rank imports them. Runs alternate:
the CUDA context made before the imports, and made in a thread while the imports run.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import threading
import time
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from bench.common import environment, start_ray, write_results


def process_started_at() -> float:
    """This process's start (``time.time()`` clock), from /proc: boot time plus its start ticks."""
    boot = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
    ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
    return boot + ticks / os.sysconf("SC_CLK_TCK")


class Probe:
    """A stand-in for a rank: notes when it was built, then times a rank's imports on request."""

    def __init__(self, asked_at: float):
        self.init_at = time.time()
        self.asked_at = asked_at
        self.process_at = process_started_at()

    def imports(self, model_dir: str | None, overlap: bool) -> dict[str, float]:
        seconds = {
            "until the worker process existed": max(0.0, self.process_at - self.asked_at),
            "worker process start to actor init": self.init_at - max(self.process_at, self.asked_at),
        }
        began = time.perf_counter()
        importlib.import_module("torch")

        seconds["import torch"] = time.perf_counter() - began
        context = threading.Thread(target=cuda_context, args=(seconds,))
        began = time.perf_counter()
        if overlap:  # the context in a thread while the main thread imports: the factory call drops the GIL
            context.start()
        else:
            context.run()
        if model_dir:
            from ray_hsdp.loading.components import import_component_classes

            import_component_classes(Path(model_dir))
        importlib.import_module("ray_hsdp.pipeline.sharded")
        if overlap:
            context.join()
        seconds["imports"] = time.perf_counter() - began - (0.0 if overlap else seconds.get("CUDA context", 0.0))
        seconds["context and imports"] = time.perf_counter() - began
        return {name: round(value, 3) for name, value in seconds.items()}


def cuda_context(seconds: dict[str, float]) -> None:
    import torch

    if torch.cuda.is_available():
        began = time.perf_counter()
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        seconds["CUDA context"] = time.perf_counter() - began


def one_start(gpus: int, model_dir: str | None, overlap: bool) -> dict:
    bundle = {"CPU": 1, **({"GPU": gpus} if gpus else {})}
    group = placement_group([bundle])
    ray.get(group.ready(), timeout=120)
    try:
        asked_at = time.time()
        actor = (
            ray.remote(Probe)
            .options(
                num_cpus=1,
                num_gpus=gpus,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=0
                ),
            )
            .remote(asked_at)
        )
        seconds = ray.get(actor.imports.remote(model_dir, overlap), timeout=300)
        seconds["total"] = round(time.time() - asked_at, 3)
        seconds = {"context": "in a thread beside the imports" if overlap else "before the imports", **seconds}
        ray.kill(actor, no_restart=True)
        return seconds
    finally:
        remove_placement_group(group)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", default=None, help="a pipeline folder whose component classes are imported")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs (context before, beside)")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--name", default="actor-start")
    args = parser.parse_args()
    start_ray()
    gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    runs = []
    for index, overlap in enumerate([False, True] * args.repeats):
        seconds = one_start(gpus, args.model_dir, overlap)
        print({"run": index + 1, **seconds}, flush=True)
        runs.append({"run": str(index + 1), **seconds})
    env = environment()  # imports torch here only after the runs: the driver's imports are not timed
    columns = list(runs[0])
    lines = [
        f"# A rank's actor start and imports, split ({'1 GPU' if gpus else 'CPU'} actors)",
        "",
        f"Machine: {', '.join(env['gpus']) or 'CPU only'}. Seconds; each run a fresh actor in a fresh placement group.",
        "",
        "| " + " | ".join(columns) + " |",
        "| " + " | ".join("---" for _ in columns) + " |",
        *("| " + " | ".join(str(run.get(c, "-")) for c in columns) + " |" for run in runs),
    ]
    lines += ["", f"Command: `python -m bench.actor_start {' '.join(sys.argv[1:])}`", ""]
    write_results(Path(args.out), args.name, {"runs": runs, "environment": env}, "\n".join(lines))


if __name__ == "__main__":
    main()
