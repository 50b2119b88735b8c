"""Where a shard group's start goes, phase by phase, with the page cache warm and cold.

    python -m bench.start --model-dir /tmp/wan14b --shard-size 4 --cold --out bench/results

Starts one group ``--repeats`` times (a warm-up start first, not recorded, so that the warm runs
find the checkpoint in the page cache; with ``--cold`` one more start after dropping the page
cache, or where the host refuses that, after evicting the model's files from it), answers one
1-step request on each (the first answer: what a client waits for after the group is ready) and
shuts it down. Records the group's phases (``describe()["start"]``: placement, rank processes and
imports, rendezvous, load, warm-up) and, per phase of the ranks, the slowest rank's seconds. On
CPU it starts the tiny model on gloo ranks.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path

from bench.common import ensure_model, environment, failure, start_ray, write_results


def drop_page_cache(model_dir: Path) -> str:
    """Drops the host's page cache; where the host does not let us (a container), evicts the
    model folder's files from it instead (``posix_fadvise``). Returns which of the two it did."""
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "page cache dropped"
    except OSError:
        for path in model_dir.rglob("*"):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        return "model files evicted from the page cache (drop_caches refused)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", default="wan2.1-t2v-14b")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--shard-size", type=int, default=4)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=2, help="warm starts recorded")
    parser.add_argument("--cold", action="store_true", help="one more start after dropping the page cache")
    parser.add_argument("--compile", action="store_true", help="groups with compile: true (their warm-up)")
    parser.add_argument(
        "--compile-cache-dir",
        default=None,
        help="the groups' compile_cache_dir; the first start (recorded then) finds it empty, the next ones full",
    )
    parser.add_argument("--ray-cpus", type=int, default=None, help="logical CPUs of the local Ray (CPU dry runs)")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--name", default=None)
    args = parser.parse_args()

    import ray

    from ray_hsdp.config import GroupConfig
    from ray_hsdp.group import ShardGroup
    from ray_hsdp.request import GenerationRequest

    model_dir = Path(args.model_dir)
    ensure_model(args.arch, model_dir, args.device)
    start_ray(args.ray_cpus)
    config = GroupConfig(
        model=str(model_dir),
        device=args.device,
        shard_size=args.shard_size,
        compile=args.compile,
        compile_cache_dir=args.compile_cache_dir,
    )
    name = args.name or f"start-{args.arch}-s{args.shard_size}"
    rows: list[dict] = []
    # With a compile cache the first start is the one that fills it: recorded.
    first = "first (compile cache empty)" if args.compile_cache_dir else "warm-up"
    runs = [first] + ["warm"] * args.repeats + (["cold"] if args.cold else [])
    for kind in runs:
        row: dict = {"run": kind}
        if kind == "cold":
            row["cache"] = drop_page_cache(model_dir)
        try:
            started = time.perf_counter()
            group = ShardGroup(config).start()
            ready = time.perf_counter() - started
            try:
                request = GenerationRequest(prompt="a fox", num_inference_steps=1, request_id="first")
                group.generate([request])
                answered = time.perf_counter() - started
                start = group.describe()["start"]
                stats = group.tick_stats()
            finally:
                group.shutdown()
            ranks: dict[str, float] = {}
            for phases in start["ranks_phases_s"]:
                for phase, seconds in phases.items():
                    ranks[phase] = max(ranks.get(phase, 0.0), seconds)
            row.update(ready_s=round(ready, 2), first_answer_s=round(answered, 2), group=start["phases_s"], ranks=ranks)
            if args.compile:
                row["fxgraph_cache"] = {
                    k: sum(s[k] for s in stats) for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")
                }
        except Exception as err:  # noqa: BLE001 - a failed start is a result; the next runs
            row["error"] = failure(err, 0)
        if kind != "warm-up":
            rows.append(row)
        print(row, flush=True)
        write_results(Path(args.out), name, {"rows": rows, "environment": environment()}, table(rows, args))
    ray.shutdown()


def table(rows: list[dict], args) -> str:
    group_phases = list(dict.fromkeys(p for r in rows for p in r.get("group", {})))
    rank_phases = list(dict.fromkeys(p for r in rows for p in r.get("ranks", {})))
    cached = any("fxgraph_cache" in r for r in rows)
    header = ["run", "ready s", "first answer s", *group_phases, *[f"rank: {p}" for p in rank_phases]]
    header += ["FX graphs found / compiled"] if cached else []
    lines = [
        f"# Group start: {args.arch}, {args.shard_size} ranks on {args.device}",
        "",
        f"GPUs: {', '.join(environment()['gpus']) or 'none'}",
        "",
        "Group phases as the group waits on them; rank phases: the slowest rank's seconds.",
        "",
        "| " + " | ".join(header) + " |",
        "| " + " | ".join("---" for _ in header) + " |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['run']} | failed: {r['error']} |" + " |" * (len(header) - 2))
            continue
        cells = [r["run"], f"{r['ready_s']:.2f}", f"{r['first_answer_s']:.2f}"]
        cells += [f"{r['group'][p]:.2f}" if p in r["group"] else "-" for p in group_phases]
        cells += [f"{r['ranks'][p]:.2f}" if p in r["ranks"] else "-" for p in rank_phases]
        if cached:
            counts = r.get("fxgraph_cache", {})
            cells.append(f"{counts.get('fxgraph_cache_hit', '-')} / {counts.get('fxgraph_cache_miss', '-')}")
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"{r['run']}: {r['cache']}." for r in rows if "cache" in r]
    lines += ["", *notes] if notes else []
    lines += ["", f"Command: `{environment()['command']}`", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
