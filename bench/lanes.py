"""Combined mode against plain diffusers: one request's denoising loop and end to end, per layout.

    python -m bench.lanes --model-dir /tmp/wan14b --sizes 1280x720 832x480 --frames 81 --steps 4 \\
        --layouts plain s2-u2 s2-cfg2 s4-u4 s4-cfg2-u2 --throughput 8

A layout is ``plain`` (``DiffusionPipeline.from_pretrained(...).to("cuda")`` on one GPU: the
baseline, in the same run) or ``s<S>-...`` (a shard group of S ranks whose lanes split requests by
``u<N>`` Ulysses, ``r<N>`` ring, ``cfg2`` CFG parallel; ``s4`` alone is 4 lanes of one rank).
Each layout runs a warm-up request of the first size (1 step, or as many as reach both experts of a
two-expert model: ``steps_reaching_every_expert``), then one guided request per size; the denoising loop is timed
from the first step's start to the last step's end (CUDA synchronised at each step), and the
result's frames are compared with the plain run's (``--parity``). ``--throughput N`` then sends N
requests at once to each group layout and reports the wall time and each request's latency.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import time
from pathlib import Path

from bench.common import (
    ensure_model,
    environment,
    failure,
    first_frame_png,
    gib,
    load_plain,
    plain_kwargs,
    random_loras,
    speed_up_plain,
    start_ray,
    write_results,
)

PROMPT = "A red fox runs through fresh snow at dawn, cinematic"


#: A layout's ``+`` suffixes that set group fields (and, on ``plain``, what diffusers does instead).
SUFFIX_FIELDS = {
    "vae": {"vae_parallel": "on"},
    "vaerows": {"vae_parallel": "rows"},  # each rank decodes a band of the rows of the whole decode
    "novae": {"vae_parallel": "off"},
    "vaecl": {"vae_channels_last": True},
    "compile": {"compile": True},
    "fp8": {"quantization": "fp8"},
    "sage": {"attention_backend": "sage"},
    "fa3fp8": {"attention_backend": "fa3_fp8"},  # FlashAttention 3's FP8 forward (Hopper)
    "cudnn": {"attention_backend": "_native_cudnn"},
    "flash": {"attention_backend": "_native_flash"},
    "keep100": {"keep_gathered": 1.0},  # the transformer whole on every rank: no gathers in a forward
    "localtext": {"shard_components": ["transformer", "transformer_2"]},  # encoders whole on every rank
}
SUFFIXES = (*SUFFIX_FIELDS, "lora", "fused")
#: The suffixes that name an attention backend (plain diffusers takes them too).
ATTENTION_SUFFIXES = tuple(s for s, fields in SUFFIX_FIELDS.items() if "attention_backend" in fields)


def suffixes_of(name: str) -> list[str]:
    """The ``+`` suffixes of a layout name, checked."""
    base, *suffixes = name.split("+")
    if unknown := [s for s in suffixes if s not in SUFFIXES]:
        raise ValueError(f"layout {name!r}: unknown suffixes {unknown}; known: {list(SUFFIXES)}")
    if base == "plain" and set(suffixes) - {"compile", *ATTENTION_SUFFIXES}:
        raise ValueError(f"layout {name!r}: plain takes only +compile and an attention backend")
    return suffixes


def layout_fields(name: str) -> dict:
    """GroupConfig fields of a layout name such as ``s4-cfg2-u2`` or ``s2-r2`` (its ``+`` suffixes
    are ``options_of``'s)."""
    suffixes_of(name)
    match = re.fullmatch(r"s(\d+)((?:-(?:u\d+|r\d+|cfg2))*)", name.split("+")[0])
    if not match:
        raise ValueError(f"layout {name!r}: expected 'plain' or s<S>[-u<N>][-r<N>][-cfg2][+{'|+'.join(SUFFIXES)}...]")
    fields = {"shard_size": int(match.group(1))}
    for part in filter(None, match.group(2).split("-")):
        if part == "cfg2":
            fields["cfg_parallel"] = True
        elif part.startswith("u"):
            fields["ulysses_degree"] = int(part[1:])
        else:
            fields["ring_degree"] = int(part[1:])
    return fields


def options_of(layout: str, args) -> tuple[dict, tuple]:
    """A layout's suffixes: ``+lora`` runs every request with one random LoRA switched per forward,
    ``+fused`` merges it into the weights at load, ``+vae`` splits every decode of more than one
    tile over the lane (``vae_parallel: on``), ``+vaerows`` shares every decode by bands of rows
    (``vae_parallel: rows``), ``+novae`` has the leader decode alone
    (``vae_parallel: off``, the default), ``+compile`` (``compile: true``), ``+fp8``
    (``quantization: fp8``), ``+sage`` / ``+fa3fp8`` / ``+cudnn`` / ``+flash`` (``attention_backend``),
    ``+vaecl`` (``vae_channels_last: true``), ``+keep100`` (``keep_gathered: 1``), ``+localtext``
    (only the denoisers sharded: each rank of the lane encodes the text itself, in no tick); several
    combine (``s4-u4+fp8+compile+cudnn``). Returns the config fields and a request's ``lora``."""
    suffixes = suffixes_of(layout)
    fields = {k: v for s in suffixes for k, v in SUFFIX_FIELDS.get(s, {}).items()}
    if not {"lora", "fused"} & set(suffixes):
        return fields, ()
    loras = random_loras(args.arch, args.lora_dir, 1, args.lora_rank, args.device)
    if "fused" in suffixes:
        return {**fields, "loras": loras, "fuse_loras": {"lora0": 1.0}}, ()
    return {**fields, "loras": loras}, (("lora0", 1.0),)


def request_for(size: str, frames: int, steps: int, request_id: str, seed: int = 0, image: bool = False):
    """One guided request; with ``image``, an image-to-video request whose first frame is the
    bench's synthetic image."""
    from ray_hsdp.request import GenerationRequest, parse_size

    width, height = parse_size(size)
    return GenerationRequest(
        image=first_frame_png(width, height) if image else None,
        prompt=PROMPT,
        width=width,
        height=height,
        num_frames=frames,
        num_inference_steps=steps,
        guidance_scale=5.0,
        seed=seed,
        request_id=request_id,
    )


def run_plain(model_dir: Path, requests: list, device: str, suffixes=()) -> tuple[list[dict], list, float]:
    """Plain diffusers on one GPU (``+compile``: diffusers' ``compile_repeated_blocks`` on its
    transformers; an attention backend: ``set_attention_backend`` on them): rows, frames, parameter
    bytes."""
    import numpy as np
    import torch

    from ray_hsdp.pipeline.sharded import steps_reaching_every_expert

    pipe = load_plain(model_dir, device)
    backends = [SUFFIX_FIELDS[s]["attention_backend"] for s in suffixes if s in ATTENTION_SUFFIXES]
    backend = backends[-1] if backends else None  # the last named, as the group's fields take it
    speed_up_plain(pipe, "compile" in suffixes, backend)
    modules = [c for c in pipe.components.values() if isinstance(c, torch.nn.Module)]
    weights = sum(p.numel() * p.element_size() for module in modules for p in module.parameters())

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    first = requests[0]
    # The same warm-up as the groups get: no row pays the first kernels' one-time costs (every
    # expert's: a 1-step warm-up of a two-expert model reaches its first alone).
    size = {"width": first.width, "height": first.height, "num_frames": first.num_frames}
    warm = {"image": first.first_frame()} if first.image is not None else {}
    steps = steps_reaching_every_expert(pipe)
    pipe(prompt="warm up", num_inference_steps=steps, output_type="latent", **size, **warm)
    rows, frames = [], []
    for request in requests:
        marks: list[float] = []

        def on_step(_pipe, _step, _t, kwargs, marks=marks):
            sync()
            marks.append(time.perf_counter())
            return kwargs

        first_call: list[float] = []

        def first(*_, seen=first_call):
            if not seen:  # the loop starts at the first transformer call (text encoding before it)
                seen.append(time.perf_counter())

        hook = pipe.transformer.register_forward_pre_hook(first)
        sync()
        start = time.perf_counter()
        out = pipe(**plain_kwargs(request, pipe), callback_on_step_end=on_step)
        sync()
        end = time.perf_counter()
        hook.remove()
        frames.append(np.asarray(out.frames, dtype=np.float32))
        rows.append(
            {
                "request": request.request_id,
                "denoising_s": round(marks[-1] - first_call[0], 3),
                "step_s": round((marks[-1] - marks[0]) / max(len(marks) - 1, 1), 3),
                "request_s": round(end - start, 3),
                "outside_denoising_s": round(end - start - (marks[-1] - first_call[0]), 3),
                "before_loop_s": round(first_call[0] - start, 3),
                "after_loop_s": round(end - marks[-1], 3),
                "handoff_s": 0.0,
            }
        )
    del pipe
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows, frames, weights


def run_group(model_dir: Path, layout: str, requests: list, args):
    """One layout's group: rows of the single requests, their frames, parameter bytes per rank,
    and the throughput run."""
    import numpy as np

    from ray_hsdp.config.group import GroupConfig
    from ray_hsdp.group import ShardGroup

    options, lora = options_of(layout, args)
    config = GroupConfig(
        model=str(model_dir), device=args.device, requests_per_rank=1, **layout_fields(layout), **options
    )
    requests = [dataclasses.replace(r, lora=lora) for r in requests]
    rows, frames, batch = [], [], None
    with ShardGroup(config) as group:
        memory = group.memory()
        first = requests[0] if requests else request_for(args.throughput_size, args.frames, 1, "w", image=args.image)
        first = dataclasses.replace(first, lora=lora)
        steps = group.pipeline_facts["warm_up_steps"]  # every expert's first forwards
        warm = dataclasses.replace(first, num_inference_steps=steps, request_id="warm-up")
        # A deadline on every wait: a layout that hangs is recorded as failed (its group shut
        # down) and the next layout runs, instead of the call's time running out on it.
        group.submit(warm).result(timeout=args.request_deadline)
        for request in requests:
            group.start_profile()
            start = time.perf_counter()
            result = group.submit(request).result(timeout=args.request_deadline)
            end = time.perf_counter()
            profiles = group.stop_profile()
            record = next(p["requests"][request.request_id] for p in profiles if request.request_id in p["requests"])
            steps = record["steps"]
            step_s = (steps[-1] - steps[0]) / max(len(steps) - 1, 1)
            # The first step's end less one step is where the loop starts (text encoding before it).
            loop_start = steps[0] - step_s
            rows.append(
                {
                    "request": request.request_id,
                    "denoising_s": round(steps[-1] - loop_start, 3),
                    "step_s": round(step_s, 3),
                    "request_s": round(end - start, 3),
                    "outside_denoising_s": round(end - start - (steps[-1] - loop_start), 3),
                    # The leader's run: text encoding before the loop, decode and answer after it;
                    # the rest of the request's time is the hand-off (queue, offer, result transfer).
                    "before_loop_s": round(loop_start - record["start"], 3),
                    "after_loop_s": round(record["end"] - steps[-1], 3),
                    "handoff_s": round(end - start - (record["end"] - record["start"]), 3),
                }
            )
            frames.append(np.asarray(result.frames, dtype=np.float32))
        if args.throughput and (args.throughput_layouts is None or layout in args.throughput_layouts):
            many = [
                dataclasses.replace(
                    request_for(args.throughput_size, args.frames, args.steps, f"t{i}", seed=i, image=args.image),
                    lora=lora,
                )
                for i in range(args.throughput)
            ]
            start = time.perf_counter()
            futures = [(time.perf_counter(), group.submit(r)) for r in many]
            latencies = []
            for submitted, future in futures:
                future.result(timeout=args.request_deadline)
                latencies.append(time.perf_counter() - submitted)
            wall = time.perf_counter() - start
            batch = {
                "requests": args.throughput,
                "size": args.throughput_size,
                "wall_s": round(wall, 3),
                "requests_per_min": round(60 * args.throughput / wall, 3),
                "latency_s_mean": round(sum(latencies) / len(latencies), 3),
                "latency_s_max": round(max(latencies), 3),
            }
    weights = [r["total"]["sharded_local"] + r["total"]["replicated"] for r in memory]
    model = memory[0]["total"]["sharded_full"] + memory[0]["total"]["replicated"]
    return rows, frames, weights, batch, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="wan2.1-t2v-14b")
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/wan14b"))
    parser.add_argument("--small-encoders", action="store_true", help="write the checkpoint with small encoders")
    parser.add_argument("--sizes", nargs="+", default=["1280x720", "832x480"])
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layouts", nargs="+", default=["plain", "s2-u2", "s2-cfg2", "s4-u4", "s4-cfg2-u2"])
    parser.add_argument("--throughput", type=int, default=0, help="requests sent at once to each group layout")
    parser.add_argument("--throughput-size", default="832x480")
    parser.add_argument(
        "--throughput-layouts", nargs="*", default=None, help="layouts that run the throughput batch (default: all)"
    )
    parser.add_argument(
        "--throughput-only",
        nargs="*",
        default=[],
        help="layouts that run only the throughput batch (e.g. s4: a batch group's single request says little)",
    )
    parser.add_argument("--image", action="store_true", help="image-to-video: each request carries a first frame")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run on gloo ranks with the tiny architecture")
    parser.add_argument("--ray-cpus", type=int, default=None, help="a Ray of its own with this many CPUs (CPU runs)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="lanes-wan2.1-t2v-14b")
    parser.add_argument("--lora-dir", type=Path, default=Path("/tmp/bench-loras"), help="the +lora layouts' LoRA")
    parser.add_argument("--lora-rank", type=int, default=64)
    parser.add_argument(
        "--request-deadline",
        type=float,
        default=600,
        help="seconds a layout's request may take before the layout is recorded as failed and the next runs",
    )
    args = parser.parse_args()

    import numpy as np

    written_s = ensure_model(args.arch, args.model_dir, args.device, small_encoders=args.small_encoders)
    requests = [request_for(size, args.frames, args.steps, size, image=args.image) for size in args.sizes]
    results: dict = {"environment": environment(), "arch": args.arch, "checkpoint_written_s": written_s, "layouts": {}}
    reference = None
    started_ray = False
    for layout in args.layouts:
        began = time.perf_counter()
        if layout.split("+")[0] == "plain":
            rows, frames, weights = run_plain(args.model_dir, requests, args.device, suffixes_of(layout))
            entry = {"rows": rows, "parameter_bytes_per_gpu": [weights]}
            if reference is None:  # the first plain layout is every other's reference
                reference = frames
            else:
                entry["max_abs_diff_to_plain"] = [float(np.abs(a - b).max()) for a, b in zip(frames, reference)]
        else:
            if not started_ray:
                start_ray(args.ray_cpus)
                started_ray = True
            try:
                singles = [] if layout in args.throughput_only else requests
                rows, frames, weights, batch, model = run_group(args.model_dir, layout, singles, args)
            except Exception as err:  # noqa: BLE001 - a layout that fails is a result of its own
                results["layouts"][layout] = {"error": failure(err, args.request_deadline)}
                print(layout, results["layouts"][layout], flush=True)
                continue
            # The unsharded model's bytes as this layout holds them (fp8 linears are half of bf16).
            entry = {"rows": rows, "parameter_bytes_per_gpu": weights, "throughput": batch, "model_bytes": model}
            if reference is not None and not {"lora", "fused"} & set(suffixes_of(layout)):  # adapters change frames
                entry["max_abs_diff_to_plain"] = [float(np.abs(a - b).max()) for a, b in zip(frames, reference)]
        entry["layout_s"] = round(time.perf_counter() - began, 1)
        results["layouts"][layout] = entry
        print(layout, entry, flush=True)
        # Written after every layout, so that a run cut short still leaves what it measured.
        write_results(args.out, args.name, results, markdown(results, args))


def outside_of(row: dict) -> str:
    """A row's time outside the denoising loop, and its parts where the row has them."""
    parts = [row.get(k) for k in ("before_loop_s", "after_loop_s", "handoff_s")]
    split = f" ({' / '.join(f'{p:.2f}' for p in parts)})" if None not in parts else ""
    return f"{row['outside_denoising_s']:.2f}{split}"


def markdown(results: dict, args) -> str:
    env = results["environment"]
    plain = results["layouts"].get("plain")
    lines = [
        f"# Combined mode vs plain diffusers: {results['arch']}, {args.frames} frames, {args.steps} steps, guidance 5",
        "",
        f"GPUs: {', '.join(env['gpus']) or 'none (CPU dry run)'}; torch {env['torch']}, "
        f"diffusers {env['diffusers']}, Ray {env['ray']}.",
        f"Command: `{env['command']}`",
        "",
        "| layout | size | denoising loop s | per step s | speed-up of the loop vs plain | request s (end to end) |"
        " outside the loop s (before / after / hand-off) | max abs diff to plain | parameters per GPU GiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for layout, entry in results["layouts"].items():
        if "error" in entry:
            lines.append(f"| {layout} | | failed: {entry['error']} | | | | | | |")
            continue
        for i, row in enumerate(entry["rows"]):
            base = plain["rows"][i]["denoising_s"] if plain else None
            speedup = f"{base / row['denoising_s']:.2f}x" if base else "n/a"
            diffs = entry.get("max_abs_diff_to_plain")
            diff = f"{diffs[i]:.4f}" if diffs else ""
            weights = max(entry["parameter_bytes_per_gpu"])
            lines.append(
                f"| {layout} | {row['request']} | {row['denoising_s']:.2f} | {row['step_s']:.2f} | {speedup} | "
                f"{row['request_s']:.2f} | {outside_of(row)} | {diff} | {gib(weights)} |"
            )
    batches = [(k, v["throughput"]) for k, v in results["layouts"].items() if v.get("throughput")]
    if batches:
        lines += ["", "| layout | requests at once | wall s | requests/min | mean latency s | max latency s |"]
        lines.append("| --- | --- | --- | --- | --- | --- |")
        for layout, b in batches:
            lines.append(
                f"| {layout} | {b['requests']} x {b['size']} | {b['wall_s']:.1f} | {b['requests_per_min']:.2f} | "
                f"{b['latency_s_mean']:.1f} | {b['latency_s_max']:.1f} |"
            )
    sized = [(k, v) for k, v in results["layouts"].items() if v.get("model_bytes")]
    if sized:
        lines += ["", "Parameters per GPU, and their share of the unsharded model as that layout stores it:"]
        for layout, entry in sized:
            most = max(entry["parameter_bytes_per_gpu"])
            lines.append(
                f"- {layout}: {gib(most)} GiB of {gib(entry['model_bytes'])} GiB "
                f"({100 * most / entry['model_bytes']:.1f}% of the model)"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
