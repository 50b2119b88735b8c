"""``ray-hsdp``: demo, serve, generate, check, build-kernels, key; the folder writers (make-tiny, make-random,
make-random-lora, quantize) are in ``writers``."""

from __future__ import annotations

import argparse
import base64
import logging
import os
import sys
import time
from pathlib import Path

from ray_hsdp.cli.serve_command import add_serve
from ray_hsdp.cli.writers import add_writers, cmd_make_random
from ray_hsdp.config.embedded import TINY_MODEL
from ray_hsdp.config.group import GroupConfig, rank_pool_env
from ray_hsdp.request import CACHE_KINDS, DEFAULT_GUIDANCE_SCALE


def _format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def memory_table(ranks: list[dict], component: str = "transformer") -> str:
    """A text table of each rank's memory: what it holds of ``component`` and in total, and whether
    its process had imported what a rank needs before it became one (Ray's preload)."""
    rows = [
        (
            "rank",
            "lane",
            "node",
            "device",
            f"{component} local",
            f"{component} full",
            "share",
            "sharded local (all)",
            "replicated",
            "kept whole",
            "buffers",
            "peak last request",
            "imports",
        ),
    ]
    for r in ranks:
        comp = r["components"].get(component, {"sharded_local": 0, "sharded_full": 0})
        share = comp["sharded_local"] / comp["sharded_full"] if comp["sharded_full"] else 1.0
        total = r["total"]
        rows.append(
            (
                str(r["rank"]),
                str(r["lane"]),
                r.get("node_ip", "?"),
                r["device"],
                _format_bytes(comp["sharded_local"]),
                _format_bytes(comp["sharded_full"]),
                f"{share:.1%}",
                _format_bytes(total["sharded_local"]),
                _format_bytes(total["replicated"]),
                _format_bytes(total.get("kept_whole", 0)),
                _format_bytes(total["buffers"]),
                _format_bytes(r["last_request_peak_device_bytes"]) if r["device"] == "cuda" else "n/a (cpu)",
                "preloaded" if r.get("preloaded") else "at its start",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _save_images(response: dict, stem: Path) -> list[Path]:
    paths = []
    for i, item in enumerate(response["data"]):
        suffix = "." + response.get("output_format", "png")
        path = stem.with_name(f"{stem.name}-{i}{suffix}") if len(response["data"]) > 1 else stem.with_suffix(suffix)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(item["b64_json"]))
        paths.append(path)
    return paths


def _group_options(parser: argparse.ArgumentParser) -> None:
    """``generate``'s group options: its adapters, step cache and quantization (``serve`` takes every
    field from ``serve_cli``)."""
    parser.add_argument(
        "--lora-file",
        action="append",
        default=[],
        metavar="NAME[.COMPONENT]=PATH",
        help="register a LoRA adapter (repeatable)",
    )
    parser.add_argument(
        "--fuse-lora",
        default=None,
        metavar="NAME[:SCALE],...",
        help="registered adapters to merge into the weights at load: every request runs with them",
    )
    parser.add_argument(
        "--cache",
        choices=("none", *CACHE_KINDS),
        default="none",
        help="step cache every request runs with (an approximation: faster, frames differ); needs shard size >= 2",
    )
    parser.add_argument(
        "--quantization",
        choices=("none", "fp8"),
        default="none",
        help="fp8: the sharded transformers' linears in FP8 (CUDA, compute capability 8.9+; frames differ)",
    )


def cmd_demo(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from ray_hsdp.serve import build_app

    start = time.perf_counter()
    # A fresh local cluster of its own, even where RAY_ADDRESS points at another one, whose idle
    # workers import what a rank needs before the group asks for its ranks.
    for key, value in rank_pool_env(args.rank_pool_size).items():
        os.environ.setdefault(key, value)
    ray.init(address="local", num_cpus=max(4, args.shard_size + 1), include_dashboard=False, log_to_driver=args.verbose)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    config = {
        "model": args.model,
        "device": "cpu",
        "shard_size": args.shard_size,
        "default_size": args.size,
        "default_steps": args.steps,
    }
    try:
        handle = serve.run(build_app(config), name="ray_hsdp_demo", route_prefix="/")
        prompts = [args.prompt, "A red fox runs through the snowy forest at dawn."][: args.shard_size]
        # One request per rank: in batch mode the group runs them at the same time.
        calls = [handle.generate.remote({"prompt": p, "seed": args.seed + i}) for i, p in enumerate(prompts)]
        responses = [c.result() for c in calls]
        pool = handle.pool.remote().result()
        out = Path(args.out)
        written = []
        for i, response in enumerate(responses):
            written += _save_images(response, out.with_name(f"{out.stem}-{i}") if len(responses) > 1 else out)
        print(
            f"\nray_hsdp demo: {pool['model']}, replicate_size={pool['replicate_size']}, "
            f"shard_size={pool['shard_size']}, mode={pool['mode']}, device={pool['device']}"
        )
        for response, prompt in zip(responses, prompts):
            print(f"  rank {response['rank']} ran {prompt!r} (seed {response['seed']}) in {response['elapsed_s']:.2f}s")
        print("\nImages written:")
        for path in written:
            print(f"  {path.resolve()}")
        # A short video job through the same group: the MP4 goes beside the images.
        clip = handle.generate_video.remote(
            {"prompt": prompts[-1], "num_frames": 9, "num_inference_steps": args.steps, "seed": args.seed}
        ).result()
        video_path = out.with_suffix(".mp4")
        video_path.write_bytes(clip["mp4"])
        print(f"\nVideo written ({clip['video']['num_frames']} frames at {clip['video']['fps']} fps):")
        print(f"  {video_path.resolve()}")
        print("\nPer-rank memory (parameter bytes each rank holds):")
        print(memory_table(pool["ranks"]))
        print(f"\nDemo took {time.perf_counter() - start:.1f}s")
    finally:
        # The local cluster goes with Serve in it. serve.shutdown() first would kill the controller
        # under the driver's open calls, and Ray prints each failed one ("Task ServeController...").
        ray.shutdown()
    return 0


def _follow(group, future, request_id: str, steps: int) -> None:
    """A progress bar of a request's denoising steps, then its decode, until ``future`` is done."""
    from tqdm.auto import tqdm

    with tqdm(total=steps, desc="queued", unit="step", disable=None) as bar:
        while not future.done():
            state = group.progress().get(request_id, {})
            if state.get("state") == "running":
                bar.set_description("decoding" if state["step"] >= steps else f"denoising (rank {state['rank']})")
                bar.update(state["step"] - bar.n)
            time.sleep(0.2)


def cmd_generate(args: argparse.Namespace) -> int:
    import ray

    from ray_hsdp.group import ShardGroup
    from ray_hsdp.request import GenerationRequest, fit_image, parse_lora, parse_size
    from ray_hsdp.serve.media import encode_mp4
    from ray_hsdp.serve.schema import image_response

    width, height = parse_size(args.size)
    out = Path(args.out)
    video = args.frames > 1 or out.suffix == ".mp4"
    image = None
    if args.image:
        try:
            image = fit_image(Path(args.image).read_bytes(), width, height)
        except (OSError, ValueError) as err:
            print(f"error: --image {args.image}: {err}", file=sys.stderr)
            return 2
    lora = parse_lora(args.lora)
    from ray_hsdp.cli.serve_flags import lora_files

    loras = lora_files(args.lora_file)
    config = GroupConfig(
        model=args.model,
        device=args.device,
        shard_size=args.shard_size,
        mode=args.mode,
        loras=loras,
        fuse_loras=dict(parse_lora(args.fuse_lora)),
        cache={"kind": args.cache},
        quantization=args.quantization,
    )
    request = GenerationRequest(
        prompt=args.prompt,
        width=width,
        height=height,
        num_frames=args.frames,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance_scale,
        guidance_scale_2=args.guidance_scale_2,
        flow_shift=args.flow_shift,
        sample_solver=args.sample_solver,
        boundary_ratio=args.boundary_ratio,
        seed=args.seed,
        n=args.n,
        request_id="cli",
        uint8_frames=video,
        image=image,
        lora=lora,
        cache=config.cache.resolve(None),
    )
    # After the config and the request: a refused one says so without waiting for Ray to start.
    ray.init(address=args.address, ignore_reinit_error=True, log_to_driver=args.verbose)
    with ShardGroup(config) as group:
        t = group.pipeline_facts.get("temporal_compression", 1)
        if video and (not group.pipeline_facts.get("video") or (args.frames - 1) % t):
            print(
                f"error: --frames must be {t}k+1 for this video model (or the model makes no videos)", file=sys.stderr
            )
            return 2
        try:
            future = group.submit(request)
        except ValueError as err:  # an image missing or not taken, an unknown lora
            print(f"error: {err}", file=sys.stderr)
            return 2
        _follow(group, future, request.request_id, args.steps)
        result = future.result()
        ranks = group.memory()
    if video:
        path = out.with_suffix(".mp4")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(encode_mp4(result.frames[0], args.fps))
        print(f"wrote {path.resolve()} ({args.frames} frames at {args.fps} fps, {width}x{height})")
    else:
        for path in _save_images(image_response(result, config.served_model_name), out):
            print(f"wrote {path.resolve()}")
    print(memory_table(ranks))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ray-hsdp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_writers(sub)
    _add_demo(sub)
    add_serve(sub)
    _add_check(sub)
    _add_build_kernels(sub)
    _add_key(sub)
    _add_generate(sub)
    return parser


def cmd_check(args: argparse.Namespace) -> int:
    """Checks each Serve YAML without starting Ray; 0 when all pass, 1 with the reasons."""
    from ray_hsdp.cli.check import check_file, render

    failed = False
    for path in args.files:
        reports = check_file(path, args.device, args.gpu_memory, args.strict)
        print(f"{path}\n{render(reports)}")
        failed = failed or any(report.failures for report in reports)
    return 1 if failed else 0


def _add_check(sub) -> None:
    """The ``check`` subcommand: Serve YAMLs checked without Ray (``ray_hsdp.cli.check``)."""
    p = sub.add_parser("check", help="check Serve YAMLs without starting Ray: refusals, layout, weights per GPU")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--device", choices=["cuda", "cpu"], help="check as on this device (default: the YAML's)")
    p.add_argument("--gpu-memory", type=float, metavar="GIB", help="fail where the weights per GPU exceed this")
    p.add_argument("--strict", action="store_true", help="fail where a model folder is not on this machine")
    p.set_defaults(func=cmd_check)


#: How long ``key set`` and ``key remove`` wait for every ingress replica to serve the change: the
#: bound ``serve.ingress.keys`` promises (its replicas look again every ``KEY_REFRESH_S``).
KEY_REACH_S = 10.0


def cmd_key(args: argparse.Namespace) -> int:
    """Stores the check of an application's API key in the running cluster, removes it, or shows
    which source each ingress replica serves with; ``set`` and ``remove`` wait until every replica
    serves the change (1 where one does not within ``KEY_REACH_S``)."""
    import ray

    from ray_hsdp.serve.ingress import keys

    if args.action == "set":
        key = keys.read_key(args.api_key_file, args.api_key_env)
        if not key:
            raise ValueError(f"no key: set {args.api_key_env} in this shell, or give --api-key-file")
        if args.keep_old_for < 0:
            raise ValueError(f"--keep-old-for takes 0 or more seconds, not {args.keep_old_for:g}")
    # A running cluster only (RAY_ADDRESS, or this node's): a key stored in a Ray started here dies with it.
    ray.init(address=os.environ.get("RAY_ADDRESS") or "auto", logging_level=logging.WARNING)
    if args.action == "show":
        reports = keys.replica_sources(args.app)
        for replica, report in reports.items():
            print(keys.describe(replica, report))
        if not reports:
            print(f"no ingress replica of {args.app!r} runs")
        return 0
    if args.action == "set":
        version = keys.store_key(args.app, key, args.keep_old_for)
        overlap = f"; the key served before is accepted too for {args.keep_old_for:g} s" if args.keep_old_for else ""
        print(f"stored the check of the API key of application {args.app!r} in the cluster (not the key); it wins "
              f"over every other source (ray-hsdp serve's, api_key_file, {args.api_key_env}){overlap}")  # fmt: skip

        def done(report: dict | None) -> bool:
            return report is not None and report["source"] == keys.STORED and report["version"] == version
    else:
        removed = keys.remove_key(args.app)
        print(f"removed the stored key of {args.app!r}" if removed else f"no stored key for {args.app!r}")

        def done(report: dict | None) -> bool:
            return report is not None and report["source"] != keys.STORED

    sys.stdout.flush()  # what was done, before the wait for the replicas
    reports = keys.wait_for_replicas(args.app, done, KEY_REACH_S)
    for replica, report in reports.items():
        print(("" if done(report) else f"NOT YET after {KEY_REACH_S:g} s: ") + keys.describe(replica, report))
    if not reports:
        print(f"no ingress replica of {args.app!r} runs now: its replicas serve with this as they start")
    return 0 if all(map(done, reports.values())) else 1


def _add_key(sub) -> None:
    """The ``key`` subcommand: an application's API key kept in the cluster (``ray_hsdp.serve.ingress.keys``)."""
    p = sub.add_parser(
        "key", help="store an application's API key in the running Ray cluster, remove it, or show which key "
        "source each replica serves with",
    )  # fmt: skip
    p.add_argument("action", choices=["set", "remove", "show"])
    p.add_argument("--app", default="ray_hsdp", help="the Serve application's name (the shipped YAMLs': ray_hsdp)")
    p.add_argument("--api-key-file", metavar="FILE", help="read the key from FILE (first line)")
    p.add_argument("--api-key-env", default="RAY_HSDP_API_KEY", metavar="VAR", help="else from this variable")
    p.add_argument(
        "--keep-old-for", type=float, default=0.0, metavar="SECONDS", help="set: accept the key served before "
        "beside the new one for SECONDS, while clients move over (default 0: refused at once)",
    )  # fmt: skip
    p.set_defaults(func=cmd_key)


def cmd_build_kernels(args: argparse.Namespace) -> int:
    """Builds a kernel's wheel for the local GPU and prints how to ship it (``ray_hsdp.cli.kernels``)."""
    from ray_hsdp.cli.kernels import BuildFailed, BuildRefused, build, shipping

    try:
        result = build(args.kernel, Path(args.source), Path(args.out), args.jobs, args.cutlass and Path(args.cutlass))
    except BuildRefused as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except BuildFailed as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(shipping(result))
    return 0


def _add_build_kernels(sub) -> None:
    """The ``build-kernels`` subcommand: a wheel of SageAttention 2 or of FlashAttention 3's FP8 forward."""
    p = sub.add_parser("build-kernels", help="build the wheel of a fast attention kernel for this host's GPU")
    from ray_hsdp.cli.kernels import KERNELS

    p.add_argument("kernel", choices=KERNELS, help="sage: SageAttention 2; fa3: FlashAttention 3 (fa3_fp8)")
    p.add_argument("--source", required=True, metavar="DIR", help="a local copy of the kernel's public repository")
    p.add_argument("--out", required=True, metavar="WHEELDIR", help="where the wheel goes")
    p.add_argument("--cutlass", metavar="DIR", help="fa3: a cutlass folder, where DIR/csrc/cutlass is empty")
    p.add_argument("--jobs", type=int, metavar="N", help="parallel compile jobs (default: the CPU count)")
    p.set_defaults(func=cmd_build_kernels)


def _add_demo(sub) -> None:
    """The ``demo`` subcommand and its arguments."""
    p = sub.add_parser("demo", help="serve the tiny model on one group of 2 CPU ranks, generate, print memory")
    p.add_argument("--model", default=TINY_MODEL)
    p.add_argument("--prompt", default="A cat and a dog baking a cake together in a kitchen.")
    p.add_argument("--shard-size", type=int, default=2)
    p.add_argument("--size", default="64x64")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--out", default="out/demo.png", help="image path (a suffix -i is added per request)")
    p.add_argument("--verbose", action="store_true", help="show the ranks' logs")
    p.add_argument(
        "--rank-pool-size", type=int, default=None, metavar="N",
        help="idle processes that imported a rank's modules ahead (default: Ray's, the CPUs; 0: none)",
    )  # fmt: skip
    p.set_defaults(func=cmd_demo)


def _add_generate(sub) -> None:
    """The ``generate`` subcommand and its arguments."""
    p = sub.add_parser("generate", help="run one request on a shard group without Serve")
    p.add_argument("model", nargs="?", default=TINY_MODEL)
    p.add_argument("--prompt", required=True)
    p.add_argument("--size", default="64x64")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--guidance-scale", type=float, default=DEFAULT_GUIDANCE_SCALE)
    p.add_argument("--guidance-scale-2", type=float, default=None, help="the low-noise expert's guidance (Wan2.2 A14B)")
    p.add_argument("--flow-shift", type=float, default=None, help="the scheduler's timestep shift (the pipeline's)")
    p.add_argument(
        "--sample-solver", choices=["unipc", "euler"], default=None, help="the scheduler of the steps (the pipeline's)"
    )
    p.add_argument(
        "--boundary-ratio", type=float, default=None, help="Wan2.2 A14B: where the low-noise expert takes over"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--shard-size", type=int, default=2)
    p.add_argument("--mode", choices=["batch", "replicated"], default="batch")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--address", default=None)
    p.add_argument("--frames", type=int, default=1, help="frames; more than 1 (or --out *.mp4) writes an MP4")
    p.add_argument("--fps", type=int, default=16, help="frame rate of the MP4 (Wan: 16)")
    p.add_argument("--out", default="out/generate.png", help="an image path, or an .mp4 for a video")
    p.add_argument("--image", default=None, help="the first frame of an image-to-video model (fitted to --size)")
    _group_options(p)
    p.add_argument("--lora", default=None, help="adapters to run with: 'name', 'name:scale,other' (registered ones)")
    p.add_argument("--verbose", action="store_true")
    p.set_defaults(func=cmd_generate)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ray-hsdp`` console script."""
    logging.basicConfig(level=logging.WARNING)
    args = build_parser().parse_args(argv)
    if getattr(args, "func", None) is cmd_make_random and args.dtype is None:
        args.dtype = "float32" if args.tiny else "bfloat16"
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
