"""SLO attainment of fixed and adaptive lanes under Poisson load, on one host's GPUs.

    python -m bench.slo --model-dir /tmp/wan14b --gpus 4 --rates 0.1 0.2 0.35 0.5 0.7 --out bench/results

Requests arrive as a Poisson process at each rate for ``--window-s`` seconds, a mix of the sizes of
``--sizes`` (the same frames and steps), each with a deadline from its arrival of ``--k`` times its
latency alone on the widest lane (measured once, in the first layout's warm-up: run ``adaptive`` or
``wide`` first, or pass ``--alone-s``). Requests carry their deadline as a target (``--targets``):
every layout serves earliest targets first, and adaptive lanes choose lanes for them. Per
layout and rate: SLO attainment (answered within the deadline), goodput (such requests per second
of the window), p50 / p95 latency from arrival, and, for adaptive lanes, the lane sizes given.
Layouts (``--layouts``): ``batch`` (lanes of one rank), ``lanes2`` (fixed Ulysses lanes of 2),
``wide`` (one Ulysses lane of all the GPUs), ``adaptive`` (``lane_sizes``: 1, 2 and all),
``adaptive-widen`` (``adaptive`` with ``lane_widening``: the requests widened are counted). Results
are written after every layout, each attainment with its 95% interval and the mean seconds queued
and running per request size and lane size, each window's requests one by one (lane, wider lane,
leader, seconds queued, running, per step, before and after the loop, latency, why one was not
answered) and the neighbour rule's fitted tick floor after it (``tick_floor``, ``TickModel``);
``--plot`` draws attainment and p95 against the rate from one or more results files, and ``--pool``
adds up the requests of several runs of one workload (runs spread over sessions), each layout's
attainment and interval then taken over all of them.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import threading
import time
from pathlib import Path

from bench.common import ensure_model, environment, failure, start_ray, write_results

LAYOUTS = ("wide", "lanes2", "batch", "adaptive", "adaptive-widen")


def layout_fields(layout: str, gpus: int) -> dict:
    """The group fields of a layout on ``gpus`` ranks."""
    return {
        "batch": {},
        "lanes2": {"ulysses_degree": 2},
        "wide": {"ulysses_degree": gpus},
        "adaptive": {"lane_sizes": sorted({1, 2, gpus})},
        "adaptive-widen": {"lane_sizes": sorted({1, 2, gpus}), "lane_widening": True},
    }[layout]


def arrivals(
    rate: float, window_s: float, sizes: list[tuple[int, int]], seed: int, exact_count: bool = False
) -> list[tuple[float, int]]:
    """Poisson arrival times in ``[0, window_s)`` at ``rate`` per second, each with a size index.
    With ``exact_count``, the process conditioned on ``round(rate x window_s)`` arrivals (their
    times independent and uniform over the window), so that a short window draws the load it names
    (a 30 s window at 0.9 req/s drew 16 arrivals in run i, fewer than at 0.7)."""
    rng = random.Random(seed)
    if exact_count:
        times = sorted(rng.uniform(0, window_s) for _ in range(round(rate * window_s)))
        return [(t, rng.randrange(len(sizes))) for t in times]
    out, t = [], rng.expovariate(rate)
    while t < window_s:
        out.append((t, rng.randrange(len(sizes))))
        t += rng.expovariate(rate)
    return out


def make_request(index: int, size: tuple[int, int], args, **fields):
    from ray_hsdp.request import GenerationRequest

    width, height = size
    return GenerationRequest(
        prompt=f"a fox runs {index}", width=width, height=height, num_frames=args.frames,
        num_inference_steps=args.steps, seed=index, request_id=f"slo-{index}", uint8_frames=True, **fields,
    )  # fmt: skip


def warm_up(group, sizes, args, lane_sizes=(None,)) -> list[float]:
    """Each size alone on each lane size (``None``: the group's one), twice: the first run of a
    shape on a lane pays for allocations and the lane's first collectives, and the group learns each
    lane's time from both. Returns each size's latency on the last lane size's second run."""
    latencies = []
    for lane_size in lane_sizes:
        latencies = []
        for round_ in range(2):
            for i, size in enumerate(sizes):
                request = make_request(10_000 + 10 * round_ + i, size, args, lane_size=lane_size)
                start = time.perf_counter()
                group.generate([request])
                latencies.append(time.perf_counter() - start)
    return latencies[len(sizes) :]


def lanes_by_size(plan: list[tuple[float, int]], records: dict, sizes: list[str]) -> tuple[dict, dict]:
    """Per request size: the lane sizes its requests got (lane size -> requests), and their mean
    seconds queued and running (lane size -> [queued, running]; running: a lane taking it to its
    answer), which tell whether a layout lost to waiting or to lanes slowed by their neighbours.
    ``records``: plan index -> the group's ``RequestRecord`` (``None``: none came)."""
    given: dict = {}
    pairs: dict = {}
    for index, (_, size_index) in enumerate(plan):
        record = records.get(index)
        if record is None or record.lane_size is None:
            continue
        size, lane = sizes[size_index], str(record.lane_size)
        given.setdefault(size, {})[lane] = given.get(size, {}).get(lane, 0) + 1
        if record.run_s is not None:
            pairs.setdefault(size, {}).setdefault(lane, []).append((record.queued_s, record.run_s))
    means = {
        size: {lane: [round(statistics.mean(p[i] for p in runs), 2) for i in (0, 1)] for lane, runs in per.items()}
        for size, per in pairs.items()
    }
    return given, means


def per_request(
    plan, records: dict, done: dict[int, float], deadlines: list[float], sizes: list[str], errors: dict[int, str]
) -> list[dict]:
    """Each request of a window in arrival order: when it arrived (seconds into the window), its
    size, the lane size it got and its leader (the lane's first rank), seconds queued and running,
    the mean seconds of its denoising steps and the seconds before and after its loop (the group's
    ``RequestRecord``: a step slower than alone was held by its neighbours' forwards; time before
    the loop is its encodings and the ticks it waited for, after it its decode), its latency
    (``None``: not answered), why it was not answered (``errors``: its error's type, or the bench's
    own stop past the drain) and whether it met its deadline, so that a run's misses can be traced
    to the lanes and neighbours they had."""
    out = []
    for index, (at, size_index) in enumerate(plan):
        record = records.get(index)
        latency = done[index] - at if index in done else None
        out.append(
            {
                "at_s": round(at, 3),
                "size": sizes[size_index],
                "lane_size": record.lane_size if record is not None else None,
                "widened_to": record.widened_to if record is not None else None,
                "leader": record.rank if record is not None else None,
                "queued_s": round(record.queued_s, 3) if record is not None and record.queued_s is not None else None,
                "run_s": round(record.run_s, 3) if record is not None and record.run_s is not None else None,
                **{
                    key: round(value, 3) if (value := getattr(record, key, None)) is not None else None
                    for key in ("step_s", "before_loop_s", "after_loop_s")
                },
                "latency_s": round(latency, 3) if latency is not None else None,
                "error": errors.get(index),
                "met": latency is not None and latency <= deadlines[size_index],
            }
        )
    return out


def run_load(group, rate: float, sizes, deadlines: list[float], args, seed: int) -> dict:
    """One Poisson window on ``group``; waits for every request (or ``--drain-s`` past the window)."""
    plan = arrivals(rate, args.window_s, sizes, seed, args.exact_count)
    records: dict = {}  # request id -> its RequestRecord (lane size, seconds queued and running)
    group.listeners.append(lambda record: records.__setitem__(record.request_id, record))
    done: dict[int, float] = {}
    errors: dict[int, str] = {}
    lock = threading.Lock()
    start = time.monotonic()

    def submit(index: int, size_index: int) -> None:
        target = time.time() + deadlines[size_index] if args.targets else None
        request = make_request(seed * 1000 + index, sizes[size_index], args, deadline=target)
        try:
            future = group.submit(request)
        except Exception as err:  # noqa: BLE001 - a refused request misses its SLO
            errors[index] = type(err).__name__
            return

        def finished(f, index=index):
            with lock:
                if f.exception() is None:
                    done[index] = time.monotonic() - start
                else:
                    errors[index] = type(f.exception()).__name__

        future.add_done_callback(finished)

    for index, (at, size_index) in enumerate(plan):
        time.sleep(max(0.0, at - (time.monotonic() - start)))
        submit(index, size_index)
    while len(done) + len(errors) < len(plan) and time.monotonic() - start < args.window_s + args.drain_s:
        time.sleep(0.05)
    with lock:  # past the drain: missed, and stopped (their cancellations are not the group's errors)
        unanswered = set(range(len(plan))) - set(done) - set(errors)
    for index in unanswered:
        group.cancel(f"slo-{seed * 1000 + index}")
    with lock:
        failed = {index: error for index, error in errors.items() if index not in unanswered}
    group.listeners.pop()
    latencies, met = [], 0
    for index, (at, size_index) in enumerate(plan):
        if index in done:
            latency = done[index] - at
            latencies.append(latency)
            met += latency <= deadlines[size_index]
    given = [record.lane_size for record in records.values() if record.lane_size is not None]
    by_index = {index: records.get(f"slo-{seed * 1000 + index}") for index in range(len(plan))}
    by_size, times = lanes_by_size(plan, by_index, args.sizes)
    return {
        "per_request": per_request(
            plan, by_index, done, deadlines, args.sizes, failed | dict.fromkeys(unanswered, "unanswered past the drain")
        ),
        "rate": rate,
        "requests": len(plan),
        "answered": len(done),
        "errors": len(failed),
        "unanswered": len(unanswered),
        "tick_floor": round(group.tick_model.floor()),  # the neighbour rule's floor after the window
        "met": met,
        "slo_attainment": round(met / len(plan), 3) if plan else None,
        "goodput_per_s": round(met / args.window_s, 3),
        "p50_s": round(statistics.median(latencies), 2) if latencies else None,
        "p95_s": round(sorted(latencies)[math.ceil(0.95 * len(latencies)) - 1], 2) if latencies else None,
        "lane_sizes_given": {str(k): given.count(k) for k in sorted(set(given))},
        "widened": sum(1 for record in records.values() if record.widened_to is not None),
        "lane_sizes_by_size": by_size,
        "queued_run_s_by_size": times,
    }


def interval(met: int, requests: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval (95% by default) of an attainment of ``met`` in ``requests``: with
    5-20 requests per load, one request moves the attainment by 5-20 points, and the interval says
    which differences between layouts the window can tell apart."""
    if not requests:
        return (0.0, 1.0)
    p, n = met / requests, requests
    centre, spread = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (max(0.0, (centre - spread) / (1 + z * z / n)), min(1.0, (centre + spread) / (1 + z * z / n)))


#: Runs pool when each size's deadline agrees within this share: one run measures the time alone
#: (1.763 s), the next is given it rounded (``--alone-s 1.76``).
POOL_TOLERANCE = 0.01
#: What runs that pool must share (with their deadlines).
POOL_FIELDS = ("arch", "gpus", "sizes", "frames", "steps", "k")


def met_of(row: dict) -> int:
    """Requests of ``row`` answered by their deadline (runs before ``met`` was written: from the
    attainment)."""
    return row.get("met", round((row["slo_attainment"] or 0) * row["requests"]))


def pooled(payloads: list[dict]) -> list[dict]:
    """The rows of several runs of one workload, added up per layout and rate (requests met and
    requests), each attainment over all of them: how runs spread over sessions reach the request
    counts that tell layouts apart. Ordered by rate, then layout.

    Raises:
        ValueError: The runs differ in a field of ``POOL_FIELDS`` or in their deadlines (named).
    """
    first = payloads[0]
    for payload in payloads[1:]:
        for field in POOL_FIELDS:
            if payload[field] != first[field]:
                raise ValueError(f"runs with different {field} do not pool: {first[field]} and {payload[field]}")
        pairs = zip(first["deadlines_s"], payload["deadlines_s"], strict=True)
        if any(abs(a - b) > POOL_TOLERANCE * a for a, b in pairs):
            raise ValueError(
                f"runs with different deadlines do not pool: {first['deadlines_s']} and {payload['deadlines_s']} s"
            )
    totals: dict[tuple[str, float], list[int]] = {}
    for payload in payloads:
        for row in payload["rows"]:
            total = totals.setdefault((row["layout"], row["rate"]), [0, 0, 0])
            total[0], total[1], total[2] = total[0] + met_of(row), total[1] + row["requests"], total[2] + 1
    return [
        {"layout": layout, "rate": rate, "met": met, "requests": requests, "runs": runs,
         "slo_attainment": round(met / requests, 3) if requests else None}
        for (layout, rate), (met, requests, runs) in sorted(totals.items(), key=lambda item: (item[0][1], item[0][0]))
    ]  # fmt: skip


def pooled_markdown(rows: list[dict], files: list[Path]) -> str:
    """``pooled`` rows as a table, with adaptive's attainment over the best fixed layout's at each rate."""
    lines = [
        f"# SLO attainment pooled over {len(files)} runs: {', '.join(f.name for f in files)}",
        "",
        "| rate (req/s) | layout | runs | requests | SLO attainment (95% interval) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        low, high = interval(row["met"], row["requests"])
        lines.append(
            f"| {row['rate']} | {row['layout']} | {row['runs']} | {row['requests']} | "
            f"{row['slo_attainment']} ({low:.2f}-{high:.2f}) |"
        )
    lines += ["", "Adaptive over the best fixed layout (relative):", ""]
    for rate in dict.fromkeys(row["rate"] for row in rows):
        at_rate = [row for row in rows if row["rate"] == rate]
        fixed = [row for row in at_rate if not row["layout"].startswith("adaptive")]
        if not fixed:
            continue
        best = max(fixed, key=lambda row: row["slo_attainment"] or 0)
        for row in (r for r in at_rate if r["layout"].startswith("adaptive")):
            gain = f"{row['slo_attainment'] / best['slo_attainment'] - 1:+.0%}" if best["slo_attainment"] else "-"
            lines.append(f"- {rate} req/s: {row['layout']} {gain} against {best['layout']}")
    return "\n".join(lines) + "\n"


def markdown(payload: dict) -> str:
    lines = [
        f"# SLO under Poisson load: {payload['arch']}, {payload['gpus']} GPUs, sizes {payload['sizes']}, "
        f"{payload['frames']} frames, {payload['steps']} steps, deadline {payload['k']}x alone on the widest lane",
        "",
        f"GPUs: {', '.join(payload['environment']['gpus']) or 'none (CPU dry run)'}; alone on the widest lane: "
        f"{payload.get('alone_s')} s (deadlines {payload.get('deadlines_s')} s); window {payload['window_s']} s"
        + (f"; every group with {payload['set']}" if payload.get("set") else ""),
        "",
        "| layout | rate (req/s) | requests (arrived per s: the load drawn) | SLO attainment (95% interval) "
        "| goodput (req/s) | p50 / p95 (s) | lane sizes given |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in payload["rows"]:
        low, high = interval(met_of(row), row["requests"])
        drawn = row["requests"] / payload["window_s"]
        lines.append(
            f"| {row['layout']} | {row['rate']} | {row['requests']} ({drawn:.2f}) | "
            f"{row['slo_attainment']} ({low:.2f}-{high:.2f}) | "
            f"{row['goodput_per_s']} | {row['p50_s']} / {row['p95_s']} | {row['lane_sizes_given'] or '-'} |"
        )
    timed_rows = [row for row in payload["rows"] if row.get("queued_run_s_by_size")]
    if timed_rows:
        lines.append("\nMean seconds queued / running (from a lane taking it), per request size and lane size:")
        lines += [f"- {row['layout']} at {row['rate']} req/s: {row['queued_run_s_by_size']}" for row in timed_rows]
    missed = [(row, r) for row in payload["rows"] for r in row.get("per_request", []) if not r["met"]]
    if missed:
        lines.append(
            "\nRequests that missed their deadline (arrival s into the window, size, lane (its leader), s queued / "
            "running, s per step, s before / after the loop, latency or why it was not answered):"
        )
        lines += [
            f"- {row['layout']} at {row['rate']} req/s: {r['at_s']} s, {r['size']}, lane {r['lane_size']} "
            f"({r.get('leader')}), {r['queued_s']} / {r['run_s']}, {r.get('step_s')}, "
            f"{r.get('before_loop_s')} / {r.get('after_loop_s')}, {r['latency_s'] or r.get('error')}"
            for row, r in missed
        ]
    for layout, times in payload.get("lane_times_s", {}).items():
        lines.append(f"\nSeconds per request after the warm-up ({layout}; lane size x work): {times}")
    for fail in payload["failed"]:
        lines.append(f"\nFailed: {fail['layout']}: {fail['error']}")
    lines.append(f"\nCommand: `{payload['environment']['command']}`")
    return "\n".join(lines) + "\n"


def plot(results: list[Path], out: Path) -> None:
    """Attainment and p95 against the rate, one line per layout, from one or more results files
    (runs of the same workload on the same arrivals, e.g. two calls that split the layouts)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    payloads = [json.loads(path.read_text()) for path in results]
    payload = payloads[0]
    all_rows = [row | {"drawn": row["requests"] / p["window_s"]} for p in payloads for row in p["rows"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for layout in dict.fromkeys(row["layout"] for row in all_rows):
        # Against the load each window drew (its arrivals over its length), in that order: a short
        # window's draw can stray far from the rate it was drawn at.
        rows = sorted((r for r in all_rows if r["layout"] == layout), key=lambda r: r["drawn"])
        drawn = [r["drawn"] for r in rows]
        left.plot(drawn, [r["slo_attainment"] for r in rows], marker="o", label=layout)
        right.plot(drawn, [r["p95_s"] for r in rows], marker="o", label=layout)
    left.set(xlabel="arrivals per second drawn", ylabel="SLO attainment", ylim=(0, 1.05))
    right.set(xlabel="arrivals per second drawn", ylabel="p95 latency from arrival (s)")
    left.legend()
    fig.suptitle(f"{payload['arch']} on {payload['gpus']} GPUs: fixed and adaptive lanes")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="wan2.1-t2v-14b")
    parser.add_argument("--model-dir")
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.1, 0.2, 0.35, 0.5, 0.7])
    parser.add_argument("--sizes", nargs="+", default=["832x480", "480x320"])
    parser.add_argument("--frames", type=int, default=21)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--k", type=float, default=3.0, help="deadline: k x the latency alone on the widest lane")
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--exact-count", action="store_true", help="each window draws rate x window arrivals "
                        "(the Poisson process conditioned on its count: uniform times)")  # fmt: skip
    parser.add_argument("--drain-s", type=float, default=60.0, help="longest wait for a window's last answers")
    parser.add_argument("--targets", action="store_true", help="requests carry their deadline (an adaptive "
                        "group's policy aims for it)")  # fmt: skip
    parser.add_argument("--alone-s", type=float, nargs="+", help="each size's latency alone on the widest lane, "
                        "measured earlier (else measured on the first layout)")  # fmt: skip
    parser.add_argument("--ray-cpus", type=int, default=None, help="logical CPUs of the local Ray (CPU dry runs)")
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=JSON", help="group fields every layout "
                        "takes, e.g. request_streams=true requests_per_rank=1")  # fmt: skip
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--name", default=None)
    parser.add_argument("--plot", nargs="+", metavar="FILE", help="only draw: results files, then the PNG to write")
    parser.add_argument("--pool", nargs="+", metavar="FILE", help="only add up: results files of one workload; "
                        "prints the pooled table")  # fmt: skip
    args = parser.parse_args()
    if args.pool:
        files = [Path(f) for f in args.pool]
        print(pooled_markdown(pooled([json.loads(f.read_text()) for f in files]), files), end="")
        return
    if args.plot:
        if len(args.plot) < 2:
            parser.error("--plot takes one or more results files and then the PNG to write")
        plot([Path(f) for f in args.plot[:-1]], Path(args.plot[-1]))
        return

    from ray_hsdp.config.group import GroupConfig
    from ray_hsdp.group import ShardGroup

    model_dir = Path(args.model_dir)
    ensure_model(args.arch, model_dir, args.device)
    start_ray(args.ray_cpus)
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes]
    name = args.name or f"slo-{args.arch}-{args.gpus}gpus"
    payload = {
        "arch": args.arch, "gpus": args.gpus, "sizes": args.sizes, "frames": args.frames, "steps": args.steps,
        "k": args.k, "window_s": args.window_s, "rows": [], "failed": [], "environment": environment(),
    }  # fmt: skip
    if args.alone_s:
        payload["alone_s"] = args.alone_s
        payload["deadlines_s"] = [round(args.k * a, 2) for a in args.alone_s]
    extra = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
    payload["set"] = extra
    for layout in args.layouts:
        config = GroupConfig(model=str(model_dir), device=args.device, shard_size=args.gpus,
                             **layout_fields(layout, args.gpus), **extra)  # fmt: skip
        try:
            with ShardGroup(config) as group:
                alone = warm_up(group, sizes, args, sorted(config.lane_sizes) or [None])  # the widest last
                if "deadlines_s" not in payload:  # measured once, on the first layout (run adaptive or wide first)
                    payload["alone_s"] = [round(a, 2) for a in alone]
                    payload["deadlines_s"] = [round(args.k * a, 2) for a in alone]
                payload.setdefault("lane_times_s", {})[layout] = group.lane_times.as_dict()
                for seed, rate in enumerate(args.rates):
                    row = run_load(group, rate, sizes, payload["deadlines_s"], args, seed=seed + 1)
                    payload["rows"].append({"layout": layout, **row})
                    print(json.dumps({k: v for k, v in payload["rows"][-1].items() if k != "per_request"}), flush=True)
                    write_results(Path(args.out), name, payload, markdown(payload))  # a run cut short keeps it
        except Exception as err:  # noqa: BLE001 - the next layout still runs
            payload["failed"].append({"layout": layout, "error": failure(err, args.drain_s)})
        write_results(Path(args.out), name, payload, markdown(payload))


if __name__ == "__main__":
    main()
