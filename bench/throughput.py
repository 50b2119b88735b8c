"""Throughput of one host's GPUs under each serving setup, in one run.

    python -m bench.throughput --model-dir /tmp/wan14b --out bench/results

Setups (N GPUs): ``plain``: plain diffusers (``from_pretrained(...).to("cuda")``, no Ray actor
protocol, no FSDP) on every GPU at once, one Ray task per GPU, each running its share of the
requests one after another: the baseline every ratio is taken against; R=N x S=1 unsharded
replicas of ours (the ceiling); ``batch`` (ours) on R x S layouts
(``--layouts``, default R=1 x S=N);
R=1 x S=N ``replicated`` (vllm-omni's standalone HSDP semantics); one GPU with diffusers' group
offload (a user without HSDP); ``batch`` on a mixed workload (steps interleaved); and
``batch-compile`` against ``plain-compile`` (``compile: true`` against diffusers'
``compile_repeated_blocks``); ``batch-inplace`` (and ``-compile``) and ``batch-fsdp2``: ``gather``
set (``batch`` takes its default); ``batch-ctas2``, ``batch-ctas8`` (and ``batch-ctas2-compile``):
``nccl_max_ctas`` set; ``batch-lora``: every request with one unfused random rank-``--lora-rank``
LoRA, ``batch-lora4``: four LoRAs registered, the requests taking them in turn (four at once on a
group of 4), ``batch-fused``: that one LoRA merged into the weights at load (``fuse_loras``;
``batch-fused-fp8-compile-sage``: with ``fp8``, ``compile`` and ``sage``), all against ``batch``
without adapters; ``batch-fbcache`` and ``batch-taylorseer``: every request with a
step cache (First Block Cache at its default threshold; TaylorSeer at a fixed schedule, one full
step in 2 after the first; ``-compile``: with ``compile: true``), each row with its share of
forwards that reused the cache and the drift of its first request's frames from the same request
uncached on the same group; ``batch-fp8`` (and ``-compile``): ``quantization: fp8``, with the drift of
its first request's frames from ``batch``'s (when ``batch`` ran first);
``batch-devicetick`` (and ``-compile``): the tick's all-gather on the GPU (``tick_exchange: device``);
``batch-sage``, ``batch-compile-sage`` against ``plain-sage``, ``plain-compile-sage``:
``attention_backend: sage`` (SageAttention 2, built on the GPU host: ``docs/attention.md``);
``ceiling-fp8-compile-fa3fp8-vaecl`` (and ``-sage-``): the unsharded replicas with the fastest
options, FP8 linears whole on each rank.
Every setup runs the same requests (480x832, ``--guidance``, 5 unless given) at each frame
count; results are written after every setup so that a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

from bench.common import (
    GpuSampler,
    ensure_model,
    environment,
    failure,
    fox_requests,
    load_plain,
    plain_kwargs,
    speed_up_plain,
    start_ray,
    write_results,
)
from bench.common import random_loras as common_random_loras


def latent_tokens(width: int, height: int, frames: int) -> int:
    # Wan: VAE 8x spatial, 4x temporal; patch 1x2x2.
    return ((frames - 1) // 4 + 1) * (height // 16) * (width // 16)


#: TaylorSeer at a fixed 2x schedule: step 0 in full, then one full step in every 2.
TAYLORSEER_2X = {"kind": "taylorseer", "interval": 2, "warmup_steps": 1}
#: Only the denoisers sharded (``shard_components``): text encoders and VAE replicated on every rank.
LOCAL_TEXT = ("transformer", "transformer_2")
#: The fastest options of issue 40: FP8 linears, compile and SageAttention.
BEST = {"quantization": "fp8", "compile": True, "attention_backend": "sage"}
#: ``BEST`` with the VAE's convolution weights channels-last.
BEST_VAECL = {**BEST, "vae_channels_last": True}
#: ``BEST_VAECL`` with FlashAttention 3's FP8 forward in sage's place (Hopper only: docs/attention.md).
FA3_VAECL = {**BEST_VAECL, "attention_backend": "fa3_fp8"}
#: Setups of ``batch`` with some of its group fields changed.
OPTIONS = {
    "batch-prefetch0": {"forward_prefetch": 0},
    "batch-prefetch2": {"forward_prefetch": 2},
    "batch-fwd2": {"max_forward_batch": 2},
    "batch-keep50": {"keep_gathered": 0.5},
    "batch-keep100": {"keep_gathered": 1.0},
    "batch-keep50-compile": {"keep_gathered": 0.5, "compile": True},
    "batch-compile": {"compile": True},
    "batch-inplace": {"gather": "in_place"},
    "batch-fsdp2": {"gather": "fsdp2"},
    "batch-inplace-compile": {"gather": "in_place", "compile": True},
    "batch-ctas2": {"nccl_max_ctas": 2},
    "batch-ctas8": {"nccl_max_ctas": 8},
    "batch-ctas2-compile": {"nccl_max_ctas": 2, "compile": True},
    "batch-devicetick": {"tick_exchange": "device"},
    "batch-devicetick-compile": {"tick_exchange": "device", "compile": True},
    "batch-fp8": {"quantization": "fp8"},
    "batch-fp8-compile": {"quantization": "fp8", "compile": True},
    "batch-sage": {"attention_backend": "sage"},
    "batch-compile-sage": {"compile": True, "attention_backend": "sage"},
    "batch-compile-sage-keep100": {"compile": True, "attention_backend": "sage", "keep_gathered": 1.0},
    "batch-fp8-compile-keep100": {"quantization": "fp8", "compile": True, "keep_gathered": 1.0},
    "batch-fp8-compile-sage": BEST,
    "batch-fp8-compile-sage-vaecl": BEST_VAECL,
    "batch-fp8-compile-sage-keep100": {**BEST, "keep_gathered": 1.0},
    # The text encoder replicated: a request's encoding runs on its rank alone, not in a tick of the group.
    "batch-localtext": {"shard_components": LOCAL_TEXT},
    "batch-fp8-compile-localtext": {"quantization": "fp8", "compile": True, "shard_components": LOCAL_TEXT},
    "batch-compile-sage-localtext": {"compile": True, "attention_backend": "sage", "shard_components": LOCAL_TEXT},
    "batch-fp8-compile-sage-localtext": {**BEST, "shard_components": LOCAL_TEXT},
    # Every option measured to help at once: no text-encoder ticks, channels-last VAE, and (keep100) the
    # denoiser kept whole after its first gather.
    "batch-fp8-compile-sage-vaecl-localtext": {**BEST_VAECL, "shard_components": LOCAL_TEXT},
    "batch-fp8-compile-sage-vaecl-keep100-localtext": {
        **BEST_VAECL,
        "keep_gathered": 1.0,
        "shard_components": LOCAL_TEXT,
    },
    "batch-fp8-compile-fa3fp8-vaecl": FA3_VAECL,
    # The decodes on the requests' own streams, the forwards and collectives on the highest priority.
    "batch-fp8-compile-fa3fp8-vaecl-streams": {**FA3_VAECL, "request_streams": True},
    "batch-fp8-compile-fa3fp8-vaecl-localtext": {**FA3_VAECL, "shard_components": LOCAL_TEXT},
    # The FP8 transformer kept whole after its first gather (14 GB per GPU): no gathers in later forwards.
    "batch-fp8-compile-fa3fp8-vaecl-keep100": {**FA3_VAECL, "keep_gathered": 1.0},
    # Unsharded replicas (one rank per GPU, the model whole on each: R x S=1) with the fastest options;
    # FP8 keeps the same linears whole (a 14B Wan transformer in FP8 is 14 GB).
    "ceiling-fp8-compile-fa3fp8-vaecl": FA3_VAECL,
    "ceiling-fp8-compile-sage-vaecl": BEST_VAECL,
    # One random LoRA merged at load (as batch-fused), with the fastest options.
    "batch-fused-fp8-compile-sage": BEST,
    "batch-fbcache": {"cache": {"kind": "first_block"}},
    "batch-taylorseer": {"cache": TAYLORSEER_2X},
    "batch-taylorseer-compile": {"cache": TAYLORSEER_2X, "compile": True},
}
#: Every setup ``--setups`` takes.
#: Plain diffusers: compiled (``compile_repeated_blocks``) and / or with SageAttention.
PLAIN = {"plain": (False, None), "plain-compile": (True, None), "plain-sage": (False, "sage"),
         "plain-compile-sage": (True, "sage")}  # fmt: skip
SETUPS = {
    *PLAIN,
    "ceiling",
    "batch",
    "replicated",
    "mixed",
    "offload",
    "batch-lora",
    "batch-lora4",
    "batch-fused",
    *OPTIONS,
}


def run_groups(groups, requests, deadline_s: float | None = None, results: list | None = None) -> dict:
    """Submits every request at once, spread over the groups; returns rate and latencies (a
    request unanswered ``deadline_s`` after the previous answer raises ``TimeoutError``); the
    results go to ``results`` when given."""
    started_at = time.time()
    start = time.perf_counter()
    futures = [(groups[i % len(groups)].submit(r), time.perf_counter()) for i, r in enumerate(requests)]
    latencies = []
    for future, submitted in futures:
        result = future.result(timeout=deadline_s)
        latencies.append(time.perf_counter() - submitted)
        if results is not None:
            results.append(result)
    wall = time.perf_counter() - start
    return {**summary(latencies, wall), "window": (started_at, time.time())}


def forwards_of(request) -> int:
    """Transformer forwards of ``request``: two per step when it is guided (diffusers' Wan runs
    classifier-free guidance for guidance_scale > 1), one when not."""
    return request.num_inference_steps * (2 if request.guidance_scale > 1 else 1)


def cache_figures(group, work, results, deadline_s: float | None) -> dict:
    """A cached setup's share of forwards that reused the cache, and the drift of its first
    request's frames from the same request run uncached on ``group`` (max and mean abs diff)."""
    reused = sum(r.cached_forwards or 0 for r in results)
    uncached = group.submit(dataclasses.replace(work[0], cache=None)).result(timeout=deadline_s)
    return {
        "cache_reused_share": round(reused / sum(forwards_of(r) for r in work), 4),
        **drift(results[0].frames, uncached.frames),
    }


#: What a rank's result says of where a request's time went (``GenerationResult``).
LOOP_PARTS = ("elapsed_s", "step_s", "before_loop_s", "after_loop_s")


def loop_parts(results) -> dict:
    """The mean over ``results`` of the seconds a rank ran each request, a step of its loop, before
    the loop (encodings) and after it (decode, frames to the host)."""
    parts = {}
    for key in LOOP_PARTS:
        values = [getattr(r, key) for r in results if getattr(r, key, None) is not None]
        if values:
            parts[key] = round(statistics.mean(values), 3)
    return parts


def loop_table(rows: list[dict], steps: int) -> list[str]:
    """The time around the loop of the rows that have it: outside = request - steps x step."""
    timed = [r for r in rows if "step_s" in r]
    if not timed:
        return []
    lines = ["", "Where a request's time went on its rank (means; outside the forwards = request - steps x step):", "",
             "| setup | frames | request s | step s | before the loop s | after the loop s | outside the forwards s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in timed:
        outside = r["elapsed_s"] - steps * r["step_s"]
        before, after = (r.get(k, float("nan")) for k in ("before_loop_s", "after_loop_s"))
        lines.append(
            f"| {r['setup']} | {r['frames']} | {r['elapsed_s']:.2f} | {r['step_s']:.3f} "
            f"| {before:.2f} | {after:.2f} | {outside:.2f} |"
        )
    return lines


def drift(frames, reference) -> dict:
    """Max and mean abs difference of two results' frames."""
    import numpy as np

    diff = np.abs(frames.astype(np.float64) - reference.astype(np.float64))
    return {"drift_max": round(float(diff.max()), 4), "drift_mean": round(float(diff.mean()), 5)}


def summary(latencies: list[float], wall: float) -> dict:
    """Rate and latencies (from the batch's start to each answer) of one measured batch of requests."""
    ordered = sorted(latencies)
    return {
        "requests": len(latencies),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(latencies) / wall, 4),
        "latency_mean_s": round(statistics.mean(latencies), 3),
        "latency_p50_s": round(ordered[len(ordered) // 2], 3),
        "latency_p95_s": round(ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))], 3),
        "latency_max_s": round(max(latencies), 3),
    }


def plain_baseline(
    model_dir: str,
    requests,
    gpus: int,
    device: str,
    compile: bool = False,
    backend: str | None = None,
    warm_steps: int | None = None,
) -> dict:
    """Plain diffusers on every GPU at once: GPU i runs requests i, i + N, ... one after another
    (with ``compile``, after diffusers' ``compile_repeated_blocks`` on its transformers; with
    ``backend``, after ``set_attention_backend`` on them).

    Each task loads and warms up first (its first request, with ``warm_steps`` steps if given),
    then times its share; the rate is the sum of the GPUs'
    own rates (N independent replicas), latencies run from each GPU's start to each answer.
    """
    import ray

    @ray.remote(num_gpus=1 if device == "cuda" else 0, num_cpus=1)
    def run(model_dir, share):
        import torch

        pipe = load_plain(model_dir, device)
        speed_up_plain(pipe, compile, backend)

        def call(r):
            pipe(**plain_kwargs(r, pipe))
            if device == "cuda":
                torch.cuda.synchronize()

        warm = share[0] if warm_steps is None else dataclasses.replace(share[0], num_inference_steps=warm_steps)
        call(warm)  # warm-up
        started_at = time.time()
        start = time.perf_counter()
        latencies = []
        for r in share:
            call(r)
            latencies.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
        return latencies, time.perf_counter() - start, peak, (started_at, time.time())

    shares = [requests[i::gpus] for i in range(gpus)]
    outcomes = ray.get([run.remote(model_dir, share) for share in shares if share])
    latencies = [t for lat, *_ in outcomes for t in lat]
    out = summary(latencies, max(wall for _, wall, *_ in outcomes))
    out["requests_per_s"] = round(sum(len(lat) / wall for lat, wall, *_ in outcomes), 4)
    out["peak_device_bytes"] = max(peak for _, _, peak, _ in outcomes)
    # Every GPU's timed share: from the first to start to the last to end.
    out["window"] = (min(w[0] for *_, w in outcomes), max(w[1] for *_, w in outcomes))
    return out


def offload_baseline(model_dir: str, requests, device: str) -> dict:
    """One GPU, plain diffusers with block-level group offload on a side stream."""
    import ray

    @ray.remote(num_gpus=1 if device == "cuda" else 0)
    def run(model_dir, requests):
        import torch

        from ray_hsdp.loading.components import load_pipeline
        from ray_hsdp.pipeline.sharded import ShardedPipeline
        from ray_hsdp.variant import RequestVariant

        pipe = load_pipeline(Path(model_dir), "bfloat16" if device == "cuda" else "float32")
        if device == "cuda":
            for name in ("transformer", "transformer_2"):
                module = getattr(pipe, name, None)
                if module is not None:
                    module.enable_group_offload(
                        torch.device("cuda"),
                        torch.device("cpu"),
                        offload_type="block_level",
                        num_blocks_per_group=1,
                        use_stream=True,
                    )
        runner = ShardedPipeline(pipe, device, rank=0)  # nothing sharded: the plain pipeline with its offload
        runner.run(RequestVariant.unchecked(requests[0]))  # warm-up
        start = time.perf_counter()
        latencies = []
        for r in requests:
            t = time.perf_counter()
            runner.run(RequestVariant.unchecked(r))
            latencies.append(time.perf_counter() - t)
        wall = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
        return {**summary(latencies, wall), "peak_device_bytes": peak}

    return ray.get(run.remote(model_dir, requests))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", default="wan2.1-t2v-14b")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--frames", type=int, nargs="+", default=[21, 81])
    parser.add_argument("--mixed-frames", type=int, nargs="+", default=[21], help="frame counts of the mixed setup")
    parser.add_argument("--offload-frames", type=int, nargs="+", default=[21], help="frame counts of the offload setup")
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--requests-per-gpu", type=int, default=2)
    parser.add_argument(
        "--warm-steps", type=int, default=None,
        help="steps of every setup's warm-up requests (the same sizes, so the same compiled graphs); "
        "default: --steps",
    )  # fmt: skip
    parser.add_argument("--guidance", type=float, default=5.0, help="guidance_scale (1: unguided, as a distilled "
                        "4-step LoRA runs)")  # fmt: skip
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--layouts", nargs="+", default=None, help="R x S layouts of the batch setup, e.g. 1x4 2x2 (default 1xGPUS)"
    )
    parser.add_argument("--ray-cpus", type=int, default=None, help="logical CPUs of the local Ray (CPU dry runs)")
    parser.add_argument(
        "--setups",
        nargs="+",
        default=["plain", "ceiling", "batch", "replicated", "mixed", "batch-prefetch0", "offload"],
    )
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--lora-dir", default="/tmp/bench-loras", help="where the lora setups' random LoRAs go")
    parser.add_argument("--lora-rank", type=int, default=64)
    parser.add_argument(
        "--request-deadline",
        type=float,
        default=600,
        help="seconds to wait for each next answer before the setup is recorded as failed and the next runs",
    )
    return parser


def planned_runs(args, parser: argparse.ArgumentParser) -> list[tuple[str, str, int, int]]:
    """The runs of ``--setups``, each as (row name, setup, replicas R, shard size S); a ``batch``
    setup runs once per ``--layouts`` entry."""
    if unknown := sorted(set(args.setups) - SETUPS):
        parser.error(f"unknown setups {unknown}; known: {sorted(SETUPS)}")
    runs = []
    for setup in args.setups:
        if setup == "batch":
            for layout in args.layouts or [f"1x{args.gpus}"]:
                replicas, shards = (int(x) for x in layout.lower().split("x"))
                if replicas * shards != args.gpus:
                    parser.error(f"layout {layout} does not use {args.gpus} GPUs")
                runs.append(("batch" if replicas == 1 else f"batch-{layout}", setup, replicas, shards))
        elif setup == "ceiling" or setup in PLAIN or setup.startswith("ceiling-"):  # one whole rank per GPU
            runs.append((setup, setup, args.gpus, 1))
        else:
            runs.append((setup, setup, 1, args.gpus))
    return runs


class ThroughputRun:
    """One run's requests, groups and rows (written after every setup, so that a run cut short
    keeps what it measured)."""

    def __init__(self, args, model_dir: Path, gpus: GpuSampler) -> None:
        self.args, self.model_dir, self.gpus = args, model_dir, gpus
        self.count = args.requests_per_gpu * args.gpus
        self.rows: list[dict] = []
        self.failed: list[dict] = []  # setups that raised or ran past --request-deadline
        self.name = f"throughput-{args.arch}"
        self.unquantized: dict = {}  # frames -> the first request's frames on ``batch`` (run before a quantized setup)

    def requests(self, frames, steps=None, count=None, loras=(), cache=None) -> list:
        """The run's requests at ``frames``; request i with adapter i mod len(loras), at scale 1."""
        args = self.args
        made = fox_requests(
            count or self.count, width=args.width, height=args.height, frames=frames, steps=steps or args.steps,
            guidance_scale=args.guidance,
        )  # fmt: skip
        made = [dataclasses.replace(r, cache=cache) for r in made]
        if not loras:
            return made
        return [dataclasses.replace(r, lora=((loras[i % len(loras)], 1.0),)) for i, r in enumerate(made)]

    def random_loras(self, count: int) -> dict[str, str]:
        args = self.args
        return common_random_loras(args.arch, Path(args.lora_dir), count, args.lora_rank, args.device)

    def group(self, **fields):
        from ray_hsdp.config.group import GroupConfig
        from ray_hsdp.group import ShardGroup

        return ShardGroup(GroupConfig(model=str(self.model_dir), device=self.args.device, **fields)).start()

    def record(self, setup: str, frames: int, result: dict, groups=()) -> None:
        memory = [r for g in groups for r in g.memory()]
        self.rows.append(
            {
                "setup": setup,
                "frames": frames,
                "tokens": latent_tokens(self.args.width, self.args.height, frames),
                **result,
                **(self.gpus.figures(*result["window"]) if "window" in result else {}),
                "weights_per_gpu_bytes": max((r["device_allocated_bytes"] for r in memory), default=None),
                "peak_per_gpu_bytes": result.get("peak_device_bytes")
                or max((r["last_request_peak_device_bytes"] for r in memory), default=None),
            }
        )
        self.write()

    def write(self) -> None:
        payload = {"rows": self.rows, "failed": self.failed, "environment": environment(), "steps": self.args.steps}
        write_results(Path(self.args.out), self.name, payload, table(self.rows, self.args, self.failed))

    def run_setup(self, row: str, setup: str, replicas: int, shard_size: int) -> None:
        args = self.args
        if setup in PLAIN:
            compiled, backend = PLAIN[setup]
            for frames in args.frames:
                outcome = plain_baseline(
                    str(self.model_dir), self.requests(frames), args.gpus, args.device, compiled, backend,
                    args.warm_steps,
                )  # fmt: skip
                self.record(setup, frames, outcome)
        elif setup == "offload":
            for frames in args.offload_frames:
                outcome = offload_baseline(str(self.model_dir), self.requests(frames, count=2), args.device)
                self.record(setup, frames, outcome)
        else:
            self.run_groups_of(row, setup, replicas, shard_size)

    def options_of(self, setup: str) -> tuple[dict, tuple[str, ...], object]:
        """The group fields of ``setup``, the adapters its requests take and their step cache."""
        from ray_hsdp.config.blocks import StepCacheConfig

        options = OPTIONS.get(setup, {})
        if setup in ("batch-lora", "batch-lora4"):
            options = {"loras": self.random_loras(4 if setup == "batch-lora4" else 1)}
        if setup.startswith("batch-fused"):
            options = {**options, "loras": self.random_loras(1), "fuse_loras": {"lora0": 1.0}}
        adapters = tuple(name for name in options.get("loras", {}) if name not in options.get("fuse_loras", {}))
        cache = StepCacheConfig(**options["cache"]).settings() if "cache" in options else None
        return options, adapters, cache

    def run_groups_of(self, row: str, setup: str, replicas: int, shard_size: int) -> None:
        """``setup`` on ``replicas`` groups of ``shard_size`` ranks, at each frame count."""
        args = self.args
        options, adapters, cache = self.options_of(setup)
        mode = "replicated" if setup == "replicated" else "batch"
        mixed_steps = [2 * args.steps, 4 * args.steps]
        groups = []
        try:
            for _ in range(replicas):
                groups.append(self.group(shard_size=shard_size, replicate_size=replicas, mode=mode, **options))
            for frames in args.mixed_frames if setup == "mixed" else args.frames:
                if setup == "mixed":
                    work = self.requests(frames, steps=mixed_steps, count=2 * self.count)
                else:
                    work = self.requests(frames, loras=adapters, cache=cache)
                # Warm-up: one request per GPU (with the adapters, each of them).
                warm = self.requests(frames, steps=args.warm_steps, count=args.gpus, loras=adapters, cache=cache)
                run_groups(groups, warm, args.request_deadline)
                self.record(row, frames, self.measure(row, frames, groups, work, options, cache), groups)
            if setup == "ceiling":  # the mixed workload's ideal: the same work on unsharded replicas
                for frames in args.mixed_frames if "mixed" in args.setups else []:
                    work = self.requests(frames, steps=mixed_steps, count=2 * self.count)
                    self.record("ceiling-mixed", frames, run_groups(groups, work, args.request_deadline), groups)
        finally:
            for g in groups:
                g.shutdown()

    def measure(self, row: str, frames: int, groups, work, options: dict, cache) -> dict:
        """One measured run of ``work`` on ``groups``: its figures, the share of forwards that reused
        a step cache, and a quantized setup's drift from ``batch``'s first request."""
        results: list = []
        result = run_groups(groups, work, self.args.request_deadline, results)
        result["forwards"] = sum(forwards_of(r) for r in work)
        result.update(loop_parts(results))
        if cache is not None:
            result.update(cache_figures(groups[0], work, results, self.args.request_deadline))
        if row == "batch":  # what a quantized setup's first request drifts from
            self.unquantized[frames] = results[0].frames
        elif "quantization" in options and frames in self.unquantized:
            result.update(drift(results[0].frames, self.unquantized[frames]))
        return result


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    runs = planned_runs(args, parser)

    import ray

    model_dir = Path(args.model_dir)
    ensure_model(args.arch, model_dir, args.device)
    start_ray(args.ray_cpus)
    with GpuSampler() as gpus:
        run = ThroughputRun(args, model_dir, gpus)
        for row, setup, replicas, shard_size in runs:
            try:
                run.run_setup(row, setup, replicas, shard_size)
            except Exception as err:  # noqa: BLE001 - a setup that fails is a result of its own; the next runs
                run.failed.append({"setup": row, "error": failure(err, args.request_deadline)})
                print(f"{row} failed: {run.failed[-1]['error']}")
                run.write()
    gpus.write_csv(Path(args.out) / f"{run.name}-gpu-samples.csv")
    ray.shutdown()


def table(rows: list[dict], args, failed: list[dict] = ()) -> str:
    by = {(r["setup"], r["frames"]): r for r in rows}
    lines = [
        f"# Throughput: {args.arch}, random {'bf16' if args.device == 'cuda' else 'fp32 tiny'} weights, "
        f"{args.width}x{args.height}, {args.steps} steps "
        f"(mixed: {2 * args.steps} and {4 * args.steps}), guidance {args.guidance:g}",
        "",
        f"GPUs: {', '.join(environment()['gpus']) or 'none'}",
        "",
        "| setup | frames | tokens | requests | requests/s | vs plain diffusers (else our ceiling) "
        "| latency p50 / p95 (s) | weights/GPU (GiB) | peak/GPU (GiB) | forwards that reused a step cache "
        "| drift (cache: from uncached, fp8: from batch): max / mean abs | SM clock MHz (slowest GPU) / power W |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        # A compiled setup against plain diffusers compiled the same way, and against plain.
        plain = by.get(("plain", r["frames"])) or by.get(("ceiling", r["frames"]))
        compiled = by.get(("plain-compile", r["frames"])) if "compile" in r["setup"] else None
        ideal = by.get(("ceiling-mixed", r["frames"]))
        if r["setup"] == "mixed" and ideal:
            ratio = f"{ideal['wall_s'] / r['wall_s']:.3f} of ideal"
        elif r["setup"] == "ceiling-mixed":
            ratio = "ideal"
        else:
            ratios = [f"{r['requests_per_s'] / plain['requests_per_s']:.3f}"] if plain else []
            if compiled and r["setup"] != "plain-compile":
                ratios.append(f"{r['requests_per_s'] / compiled['requests_per_s']:.3f} of plain-compile")
            ratio = "; ".join(ratios) or "-"
        weights = f"{r['weights_per_gpu_bytes'] / 2**30:.2f}" if r.get("weights_per_gpu_bytes") else "-"
        peak = f"{r['peak_per_gpu_bytes'] / 2**30:.2f}" if r.get("peak_per_gpu_bytes") else "-"
        reused = f"{r['cache_reused_share']:.0%}" if "cache_reused_share" in r else "-"
        drift = f"{r['drift_max']:.4f} / {r['drift_mean']:.5f}" if "drift_max" in r else "-"
        clock = (
            f"{r['sm_clock_mhz']:.0f} ({r['sm_clock_slowest_gpu_mhz']:.0f}) / {r['power_w']:.0f}"
            if "sm_clock_mhz" in r
            else "-"
        )
        lines.append(
            f"| {r['setup']} | {r['frames']} | {r['tokens']} | {r['requests']} | {r['requests_per_s']:.3f} "
            f"| {ratio} | {r['latency_p50_s']:.2f} / {r['latency_p95_s']:.2f} | {weights} | {peak} | {reused} "
            f"| {drift} | {clock} |"
        )
    lines += [f"| {f['setup']} | | | | failed: {f['error']} | | | | | | | |" for f in failed]
    lines += loop_table(rows, args.steps)
    lines += ["", f"Command: `{environment()['command']}`", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
