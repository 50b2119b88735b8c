"""A group's sleep and wake against its start and the host-to-device link (issue 83).

    python -m bench.sleep_wake --config serve_configs/wan2.1_t2v_14b_fast_1gpu.yaml --model-dir /tmp/wan14b-fp8 \
        --set attention_backend=auto --compile-cache-dir /tmp/compile-cache --steps 4 --cycles 3

Starts the YAML's group as a Serve replica builds it (its warm-up shapes compiled), answers two
requests at the first warmed shape (the warm time), then ``--cycles`` times: sleeps the group
(the device's free memory before and after, from each rank's ``torch.cuda.mem_get_info``), wakes
it, and answers the same request with the same seed (its time against the warm one, its frames
against the warm request's). The baseline in the same run: this process copies the bytes a rank
parks from pinned host memory to the GPU and back (the link's speed), and the group's own start.
On CPU it runs the tiny model on gloo ranks (a dry run of the steps).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from bench.common import ensure_model, environment, failure, start_ray, write_results
from bench.start import build, group_config, timed_requests


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", default="wan2.1-t2v-14b")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--config", type=Path, required=True, help="a Serve YAML: its first application's args")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--compile-cache-dir", default=None)
    parser.add_argument("--steps", type=int, default=4, help="steps of each timed request")
    parser.add_argument("--cycles", type=int, default=3, help="sleep, wake and request, this many times")
    parser.add_argument(
        "--cold-cycles",
        type=int,
        default=0,
        help="sleep_level 2: the last this many cycles drop the files' page cache before the wake (it reads the disk)",
    )
    parser.add_argument("--ray-cpus", type=int, default=None, help="logical CPUs of the local Ray (CPU dry runs)")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--name", default=None)
    return parser


def link_copy(nbytes: int) -> dict:
    """Seconds to copy ``nbytes`` between pinned host memory and the GPU, each way (the physical
    limit of a sleep and a wake), and the host-to-device copy from pageable memory."""
    import torch

    if not torch.cuda.is_available():
        return {}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {"bytes": nbytes}
    for name, source, target in (("to_gpu_s", host, device), ("to_host_s", device, host)):
        for _ in range(2):  # the first copy warms the path up; the second is timed
            torch.cuda.synchronize()
            started = time.perf_counter()
            target.copy_(source, non_blocking=True)
            torch.cuda.synchronize()
        out[name] = round(time.perf_counter() - started, 4)
    host = None  # its pinned pages back before the pageable copy
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    started = time.perf_counter()
    device.copy_(pageable)
    torch.cuda.synchronize()
    out["pageable_to_gpu_s"] = round(time.perf_counter() - started, 4)
    device = pageable = source = target = None
    torch.cuda.empty_cache()  # this process's copy of the bytes leaves the GPU before the cycles
    return out


def drop_page_cache(folder: str) -> None:
    """Writes the level-2 files of ``folder`` back and drops them from the page cache (no root needed)."""
    for path in Path(folder).glob("rank-*.bin"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cycle(group, request, warm_frames, cold_folder: str | None) -> dict:
    """One sleep, wake and request: their seconds, the device's free memory, the frames' match;
    with ``cold_folder``, its level-2 files leave the page cache before the wake."""
    slept = group.sleep()
    if cold_folder is not None:
        drop_page_cache(cold_folder)
    woke = group.wake()
    result = group.generate([request])[0]
    worst = max(slept["ranks"], key=lambda r: r["seconds"])
    return {
        "level": worst.get("level", 1),
        "page_cache": "dropped" if cold_folder is not None else "kept",
        "sleep_s": slept["seconds"],
        "wake_s": woke["seconds"],
        "parked_bytes": slept["bytes"],
        "free_before_sleep_gib": round(worst["device_free_before"] / 2**30, 2),
        "free_asleep_gib": round(worst["device_free_after"] / 2**30, 2),
        "free_awake_gib": round(max(r["device_free_after"] for r in woke["ranks"]) / 2**30, 2),
        "wake_parts_s": max(woke["ranks"], key=lambda r: r["seconds"])["parts_s"],
        "request_after_wake_s": round(result.elapsed_s, 3),
        "frames_max_abs_diff": float(np.abs(result.frames.astype(np.float64) - warm_frames).max()),
    }


def main() -> None:
    args = build_parser().parse_args()
    import ray

    from ray_hsdp.group import residency

    ensure_model(args.arch, Path(args.model_dir), args.device)
    start_ray(args.ray_cpus)
    config = group_config(args)
    name = args.name or "sleep-wake"
    started = time.perf_counter()
    group = build(config)
    row: dict = {"group_ready_s": round(time.perf_counter() - started, 2), "group_phases_s": group.phases.seconds}
    try:
        requests = timed_requests(config, group.pipeline_facts, args.steps)
        # The first request may be a first of its shape: the last of them again is the warm time.
        warm = [group.generate([r])[0] for r in [*requests, requests[-1]]]
        row["warm_requests_s"] = [round(r.elapsed_s, 3) for r in warm]
        row["shape"] = f"{requests[0].width}x{requests[0].height}x{requests[0].num_frames}, {args.steps} steps"
        reserved = residency.reserve_host(group.ranks, 600)
        row["host_reserve"] = reserved
        row["link"] = link_copy(reserved["bytes"])
        warm_frames = warm[-1].frames.astype(np.float64)
        row["cycles"] = []
        for i in range(args.cycles):
            cold = config.sleep_level == 2 and i >= args.cycles - args.cold_cycles
            row["cycles"].append(cycle(group, requests[-1], warm_frames, config.sleep_folder if cold else None))
            print(row["cycles"][-1], flush=True)
            write(args, row, config, name)  # as it goes: a run cut short keeps its cycles
    except Exception as err:  # noqa: BLE001 - a failed run is a result
        row["error"] = failure(err, 0)
    finally:
        group.shutdown()
    write(args, row, config, name)
    ray.shutdown()


def write(args, row: dict, config, name: str) -> None:
    argv = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    payload = {"row": row, "config": config.model_dump(mode="json"), "environment": environment(), "argv": argv}
    write_results(Path(args.out), name, payload, table(row))


def table(row: dict) -> str:
    gpus = ", ".join(environment()["gpus"]) or "CPU"
    lines = [
        f"# Sleep and wake of one group ({gpus})",
        "",
        f"Group ready after {row.get('group_ready_s')} s; warm requests {row.get('warm_requests_s')} s "
        f"({row.get('shape')}). Host buffers: {row.get('host_reserve')}. Link (this process, same bytes): "
        f"{row.get('link')}.",
        "",
        "| cycle | level | sleep s | wake s | bytes parked per rank | free GiB before / asleep / awake "
        "| request after wake s | vs warm | frames max abs diff |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    warm = (row.get("warm_requests_s") or [0])[-1] or 1
    for i, c in enumerate(row.get("cycles", [])):
        lines.append(
            f"| {i + 1} | {c.get('level', 1)}{' (page cache dropped)' if c.get('page_cache') == 'dropped' else ''} "
            f"| {c['sleep_s']} | {c['wake_s']} | {c['parked_bytes'] / 2**30:.2f} GiB | "
            f"{c['free_before_sleep_gib']} / {c['free_asleep_gib']} / {c['free_awake_gib']} | "
            f"{c['request_after_wake_s']} | {c['request_after_wake_s'] / warm:.3f}x | {c['frames_max_abs_diff']:g} |"
        )
    if "error" in row:
        lines.append(f"\nError: {row['error']}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
