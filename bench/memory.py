"""Memory of a shard group on GPUs: weights per GPU, peak during one forward, load time, host RSS.

    python -m bench.memory --arch wan2.1-t2v-14b --model-dir /tmp/wan14b --shard-sizes 1 2 --out bench/results

Builds the architecture with random bf16 weights (``make-random``) unless the folder exists, then
for each shard size starts a group through Ray on this host's GPUs, runs one request of one
denoising step without guidance (one transformer forward per rank) and reads each rank's report.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.common import ensure_model, environment, fox_requests, gib, start_ray, write_results


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", default="wan2.1-t2v-14b")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--shard-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--frames", type=int, default=21)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--ray-cpus", type=int, default=None, help="logical CPUs of the local Ray (CPU dry runs)")
    parser.add_argument("--out", default="bench/results")
    return parser


def measure(model_dir: Path, shard_size: int, args) -> dict:
    """A group of ``shard_size`` ranks: its start, one request per rank (after a warm-up one), and
    each rank's memory report."""
    from ray_hsdp.config.group import GroupConfig
    from ray_hsdp.group import ShardGroup

    config = GroupConfig(model=str(model_dir), device=args.device, shard_size=shard_size, mode="batch")
    start = time.perf_counter()
    group = ShardGroup(config).start()
    start_s = time.perf_counter() - start
    try:
        requests = fox_requests(
            shard_size, width=args.width, height=args.height, frames=args.frames, steps=1, guidance_scale=1.0
        )
        group.generate(requests)  # warm-up: kernels, allocator
        start = time.perf_counter()
        results = group.generate(requests)
        request_s = time.perf_counter() - start
        ranks = group.memory()
    finally:
        group.shutdown()
    return {
        "shard_size": shard_size,
        "group_start_s": round(start_s, 2),
        "request_s": round(request_s, 3),
        "ranks": [
            {
                "rank": r["rank"],
                "weights_device_bytes": r["device_allocated_bytes"],
                # Both experts of a two-expert pipeline (transformer and transformer_2).
                "transformer_local_bytes": sum(
                    c["sharded_local"] + c["replicated"]
                    for name, c in r["components"].items()
                    if name.startswith("transformer")
                ),
                "param_bytes": r["total"]["sharded_local"] + r["total"]["replicated"],
                "peak_request_bytes": res.peak_device_bytes,
                "load_s": r["load_s"],
                "load_peak_rss_bytes": r["load_peak_rss_bytes"],
            }
            for r, res in zip(ranks, results)
        ],
    }


def markdown(payload: dict, args) -> str:
    runs, checkpoint_bytes = payload["runs"], payload["checkpoint_bytes"]
    base = max(runs[0]["ranks"][0]["param_bytes"], 1)
    lines = [
        f"# Memory per GPU: {args.arch}, random bf16 weights, {args.width}x{args.height}, {args.frames} frames",
        "",
        f"GPU: {', '.join(sorted(set(payload['environment']['gpus']))) or 'none'}; checkpoint "
        f"{gib(checkpoint_bytes)} GiB (transformer {gib(payload['transformer_bytes'])} GiB). One request per rank, "
        "one step, no guidance.",
        "",
        "| S | rank | parameters on GPU (GiB) | vs S=first | allocated after load (GiB) | peak in request (GiB) "
        "| load (s) | host RSS rise while loading (GiB) | RSS / checkpoint |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        for r in run["ranks"]:
            lines.append(
                f"| {run['shard_size']} | {r['rank']} | {gib(r['param_bytes'])} | {r['param_bytes'] / base:.1%} "
                f"| {gib(r['weights_device_bytes'])} | {gib(r['peak_request_bytes'])} | {r['load_s']:.1f} "
                f"| {gib(r['load_peak_rss_bytes'])} | {r['load_peak_rss_bytes'] / checkpoint_bytes:.1%} |"
            )
    lines += ["", f"Command: `{payload['environment']['command']}`", ""]
    return "\n".join(lines)


def main() -> None:
    args = build_parser().parse_args()

    import ray

    model_dir = Path(args.model_dir)
    write_s = ensure_model(args.arch, model_dir, args.device)
    start_ray(args.ray_cpus)
    runs = [measure(model_dir, shard_size, args) for shard_size in args.shard_sizes]
    ray.shutdown()
    payload = {
        "arch": args.arch,
        "checkpoint_bytes": folder_bytes(model_dir),
        "transformer_bytes": folder_bytes(model_dir / "transformer"),
        "write_s": write_s,
        "runs": runs,
        "environment": environment(),
    }
    write_results(Path(args.out), f"memory-{args.arch}", payload, markdown(payload, args))


if __name__ == "__main__":
    main()
