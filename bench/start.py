"""Where a shard group's start goes, phase by phase, with the page cache warm and cold.

    python -m bench.start --model-dir /tmp/wan14b --shard-size 4 --cold --out bench/results

Starts one group ``--repeats`` times (a warm-up start first, not recorded, so that the warm runs
find the checkpoint in the page cache; with ``--cold`` one more start after dropping the page
cache, or where the host refuses that, after evicting the model's files from it), answers one
1-step request on each (the first answer: what a client waits for after the group is ready) and
shuts it down. Records the group's phases (``describe()["start"]``: placement, rank processes and
imports, rendezvous, load, warm-up) and, per phase of the ranks, the slowest rank's seconds. On
CPU it starts the tiny model on gloo ranks.

With ``--config YAML`` the group is configured by the YAML's first application (``--model-dir`` its
model, ``--set FIELD=VALUE`` any other field) and starts as a Serve replica builds its group: its
``warm_up`` shapes run through a request's path. Then two requests at the first warmed shape are
timed (each its group's ``elapsed_s``: the first should take as long as the second), and with
``--kill`` the last start's rank 0 is killed and the time to the next request answered (by the
rebuilt, warmed group) recorded:

    python -m bench.start --config serve_configs/wan2.1_t2v_14b_fast_1gpu.yaml --model-dir /tmp/wan14b-fp8 \
        --set attention_backend=auto --compile-cache-dir /tmp/compile-cache --repeats 1 --kill
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path

import yaml

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


def build_parser() -> argparse.ArgumentParser:
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
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="a Serve YAML: its first application's args (model: --model-dir) configure the group, which starts "
        "and warms its warm_up shapes as a replica does; then two requests at the first shape are timed",
    )
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a field of the args")
    parser.add_argument("--steps", type=int, default=8, help="steps of the timed requests (with --config)")
    parser.add_argument(
        "--kill", action="store_true", help="then kill rank 0: seconds to the next answer (mended or rebuilt)"
    )
    parser.add_argument("--ray-cpus", type=int, default=None, help="logical CPUs of the local Ray (CPU dry runs)")
    parser.add_argument(
        "--preload", action="store_true", help="the local Ray's workers import what a rank needs before any rank starts"
    )
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--name", default=None)
    return parser


def group_config(args):
    """The groups' configuration: a Serve YAML's args (``AppConfig``), or the flags' ``GroupConfig``."""
    from ray_hsdp.cli.serve_flags import parse_value, set_dotted
    from ray_hsdp.config.app import AppConfig
    from ray_hsdp.config.group import GroupConfig

    if args.config is None:
        fields = {"shard_size": args.shard_size, "compile": args.compile}
        cls = GroupConfig
    else:
        fields = dict(yaml.safe_load(args.config.read_text())["applications"][0]["args"])
        cls = AppConfig
    fields.update(model=args.model_dir, device=args.device)
    if args.compile_cache_dir:
        fields["compile_cache_dir"] = args.compile_cache_dir
    for field in args.set:  # as `ray-hsdp serve --set` reads them: JSON where it parses, dotted names
        name, _, value = field.partition("=")
        set_dotted(fields, name, parse_value(value))
    return cls(**fields)


def main() -> None:
    args = build_parser().parse_args()
    import ray

    model_dir = Path(args.model_dir)
    ensure_model(args.arch, model_dir, args.device)
    start_ray(args.ray_cpus, preload=args.preload)
    config = group_config(args)
    name = args.name or f"start-{args.arch}-s{config.shard_size}"
    rows: list[dict] = []
    # With a compile cache the first start is the one that fills it: recorded.
    empty = args.compile_cache_dir and not any(Path(args.compile_cache_dir).glob("*"))
    first = "first (compile cache empty)" if empty else "warm-up"
    runs = [first] + ["warm"] * args.repeats + (["cold"] if args.cold else [])
    for kind in runs:
        row: dict = {"run": kind}
        if kind == "cold":
            row["cache"] = drop_page_cache(model_dir)
        try:
            row.update(one_start(config, args, kill=args.kill and kind == runs[-1]))
        except Exception as err:  # noqa: BLE001 - a failed start is a result; the next runs
            row["error"] = failure(err, 0)
        if kind != "warm-up":
            rows.append(row)
        print(row, flush=True)
        payload = {"rows": rows, "config": config.model_dump(mode="json"), "environment": environment()}
        write_results(Path(args.out), name, payload, table(rows, args, config))
    ray.shutdown()


def build(config):
    """A started group, as a Serve replica builds its own (with ``--config``: its shapes warmed)."""
    from ray_hsdp.config.app import AppConfig
    from ray_hsdp.group import ShardGroup
    from ray_hsdp.serve.replica.warm_up import start_warm

    group = ShardGroup(config)
    return start_warm(group, config) if isinstance(config, AppConfig) else group.start()


def one_start(config, args, kill: bool) -> dict:
    """One start, its first answers, and with ``kill`` a rank's kill to the rebuilt group's answer."""
    from ray_hsdp.serve.replica.keeper import GroupKeeper

    started = time.perf_counter()
    keeper = GroupKeeper(lambda: build(config))
    group = keeper.group
    ready = time.perf_counter() - started
    try:
        requests = timed_requests(config, group.pipeline_facts, args.steps)
        results = [group.generate([request])[0] for request in requests]
        answered = time.perf_counter() - started
        start, stats = group.describe()["start"], group.tick_stats()
        row = {"ready_s": round(ready, 2), "first_answer_s": round(answered, 2), "group": start["phases_s"]}
        row["ranks"] = slowest_rank_phases(start["ranks_phases_s"])
        row["warm_up"] = start["warm_up"]
        if len(results) > 1:
            row["requests_elapsed_s"] = [round(r.elapsed_s, 3) for r in results]
            row["requests_decode_s"] = [round(r.after_loop_s, 3) for r in results if r.after_loop_s is not None]
            row["encode_s"] = encode_seconds(results[-1], requests[-1])
            row["shape"] = f"{requests[0].width}x{requests[0].height}x{requests[0].num_frames}, {args.steps} steps"
        if config.compile:
            row["fxgraph_cache"] = {k: sum(s[k] for s in stats) for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")}
            row["compiled_graphs"] = [s["compiled_graphs"] for s in stats]
        if kill:
            row.update(kill_to_answer(keeper, requests[-1]))
    finally:
        keeper.shutdown()
    return row


def encode_seconds(result, request) -> float:
    """Seconds to encode ``result`` as its response (an MP4 and its thumbnail, or a PNG) once the
    warm-up encoded one: what the warm-up's first encoding is compared with."""
    from ray_hsdp.serve.media import encode_mp4, encode_png

    started = time.perf_counter()
    frames = result.frames[0]
    if request.num_frames > 1:
        encode_mp4(frames, 16)
    encode_png(frames[0])
    return round(time.perf_counter() - started, 3)


def timed_requests(config, facts: dict, steps: int) -> list:
    """Two requests at the config's first warmed shape (a Serve YAML's), or one 1-step request."""
    import dataclasses

    from ray_hsdp.config.app import AppConfig
    from ray_hsdp.request import GenerationRequest
    from ray_hsdp.serve.replica.warm_up import warm_up_request

    shapes = config.warm_up_shapes() if isinstance(config, AppConfig) else []
    if not shapes:
        return [GenerationRequest(prompt="a fox", num_inference_steps=1, request_id="first")]
    request, _ = warm_up_request(shapes[0], config, facts, 0)
    return [
        dataclasses.replace(request, prompt="a red fox in the snow", num_inference_steps=steps, request_id=f"timed-{i}")
        for i in range(2)
    ]


def kill_to_answer(keeper, request) -> dict:
    """Kills the group's rank 0 and returns the seconds until ``request`` was answered again: by the
    group with that rank replaced alone (``mend_lost_rank``: its mend's phases too), or by the
    rebuilt, warmed group (the keeper notices the death, shuts the group down and builds a new one).
    A request that lands on the dead rank before the group noticed is sent again."""
    import dataclasses

    import ray

    from ray_hsdp.group import GroupFailedError

    failed = keeper.group
    mends = len(failed.mends)
    killed = time.perf_counter()
    ray.kill(failed.ranks[0], no_restart=True)
    for attempt in range(1000):
        group = keeper.current().result(timeout=1800)  # a rebuild's future once the death is noticed
        try:
            group.generate([dataclasses.replace(request, request_id=f"after-kill-{attempt}")])
            break
        except GroupFailedError:
            time.sleep(0.05)  # the group had not noticed yet, or failed under the request
    out = {"kill_to_answer_s": round(time.perf_counter() - killed, 2)}
    if group is failed and len(group.mends) > mends:
        out["mend_phases_s"] = group.mends[-1]["phases_s"]
    return out


def slowest_rank_phases(ranks_phases: list[dict]) -> dict[str, float]:
    ranks: dict[str, float] = {}
    for phases in ranks_phases:
        for phase, seconds in phases.items():
            ranks[phase] = max(ranks.get(phase, 0.0), seconds)
    return ranks


def table(rows: list[dict], args, config) -> str:
    group_phases = list(dict.fromkeys(p for r in rows for p in r.get("group", {})))
    rank_phases = list(dict.fromkeys(p for r in rows for p in r.get("ranks", {})))
    cached = any("fxgraph_cache" in r for r in rows)
    header = ["run", "ready s", "first answer s", *group_phases, *[f"rank: {p}" for p in rank_phases]]
    header += ["FX graphs found / compiled"] if cached else []
    timed = any("requests_elapsed_s" in r for r in rows)
    header += ["first / second request s (ratio)"] if timed else []
    killed = any("kill_to_answer_s" in r for r in rows)
    header += ["rank killed to next answer s"] if killed else []
    source = f" from `{args.config}`" if args.config else ""
    lines = [
        f"# Group start{source}: {args.arch}, {config.shard_size} ranks on {args.device}",
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
        if timed:
            first, second = r.get("requests_elapsed_s", [0.0, 0.0])
            cells.append(f"{first:.2f} / {second:.2f} ({first / second:.3f}) at {r['shape']}" if second else "-")
        if killed:
            mended = " (rank replaced alone)" if "mend_phases_s" in r else " (group rebuilt)"
            cells.append(f"{r['kill_to_answer_s']:.2f}{mended}" if "kill_to_answer_s" in r else "-")
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"{r['run']}: {r['cache']}." for r in rows if "cache" in r]
    notes += [f"{r['run']}: the mend's phases (s): {r['mend_phases_s']}." for r in rows if "mend_phases_s" in r]
    notes += [
        f"{r['run']}: the warm-up's record {r['warm_up']}; the timed requests' decodes {r.get('requests_decode_s')} "
        f"s, an encoding after the warm-up's {r.get('encode_s')} s."
        for r in rows
        if r.get("warm_up")
    ]
    lines += ["", *notes] if notes else []
    lines += ["", f"Command: `{environment()['command']}`", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
