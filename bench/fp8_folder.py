"""An FP8 folder against quantizing at the start, on one GPU: ``ray-hsdp quantize`` of a model, then
the pipeline loaded by a rank of its own (``ShardedPipeline.load``, no Ray) from the source with
``quantization: fp8`` and from the FP8 folder, phase by phase; one transformer forward of each on
the same inputs must be equal. A plain read of each folder's transformer files (8 threads, from the
page cache) gives the disk's side of the GB/s.

    python -m bench.fp8_folder --model-dir /tmp/wan14b --fp8-dir /tmp/wan14b-fp8
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import ensure_model, environment, write_results

CHUNK = 64 * 2**20


def plain_read(folder: Path) -> dict:
    """Seconds and GB/s to read every file of ``folder`` with 8 threads, each in 64 MiB pieces."""

    def read(path: Path) -> int:
        total = 0
        with open(path, "rb", buffering=0) as f:
            buffer = bytearray(CHUNK)
            while n := f.readinto(buffer):
                total += n
        return total

    files = [p for p in folder.rglob("*.safetensors")]
    started = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        total = sum(pool.map(read, files))
    seconds = time.perf_counter() - started
    return {"bytes": total, "s": round(seconds, 2), "GB/s": round(total / seconds / 1e9, 2)}


def load(path: Path, phases_name: str):
    from ray_hsdp.config.group import GroupConfig
    from ray_hsdp.phases import Phases
    from ray_hsdp.pipeline.sharded import LoadOptions, ShardedPipeline

    phases = Phases(phases_name)
    started = time.perf_counter()
    pipeline = ShardedPipeline.load(path, LoadOptions(
        dtype="bfloat16", device="cuda", rank=0, mesh=None, shard_components=GroupConfig().shard_components,
        min_num_params=GroupConfig().min_num_params, reshard_after_forward=True, forward_prefetch=1,
        quantization="fp8", phases=phases,
    ))  # fmt: skip
    return pipeline, round(time.perf_counter() - started, 2), dict(phases.seconds)


def forward(transformer):
    import torch

    torch.manual_seed(0)
    config = transformer.config
    inputs = dict(
        hidden_states=torch.randn(1, config.in_channels, 21, 60, 104, device="cuda", dtype=torch.bfloat16),
        timestep=torch.tensor([500], device="cuda"),
        encoder_hidden_states=torch.randn(1, 512, config.text_dim, device="cuda", dtype=torch.bfloat16),
    )
    with torch.no_grad():
        return transformer(**inputs, return_dict=False)[0]


def differing_tensors(a, b) -> list[str]:
    """Names of the parameters and buffers (persistent or not) whose bytes differ between the two
    modules, with their dtypes."""
    import torch

    def tensors(module):
        return {**dict(module.named_parameters()), **dict(module.named_buffers())}

    ta, tb = tensors(a), tensors(b)
    out = [f"{n}: only in one" for n in sorted(set(ta) ^ set(tb))]
    for name in sorted(set(ta) & set(tb)):
        x, y = ta[name], tb[name]
        if x is None or y is None:
            if (x is None) != (y is None):
                out.append(f"{name}: None in one")
            continue
        if x.dtype != y.dtype or x.shape != y.shape:
            out.append(f"{name}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}")
        elif not torch.equal(x.detach().reshape(-1).view(torch.uint8), y.detach().reshape(-1).view(torch.uint8)):
            out.append(f"{name}: {x.dtype} bytes differ")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", default="wan2.1-t2v-14b")
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--fp8-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="fp8-folder-wan2.1-t2v-14b")
    args = parser.parse_args()

    import torch

    from ray_hsdp.cli.quantize import write_fp8_folder
    from ray_hsdp.config.group import GroupConfig

    ensure_model(args.arch, args.model_dir, "cuda")
    result: dict = {"environment": environment()}
    if not args.fp8_dir.exists():
        started = time.perf_counter()
        write_fp8_folder(args.model_dir, args.fp8_dir, dtype="bfloat16", min_num_params=GroupConfig().min_num_params,
                         shard_components=GroupConfig().shard_components, fused={})  # fmt: skip
        result["quantize_s"] = round(time.perf_counter() - started, 1)
    result["plain_read"] = {
        "source transformer": plain_read(args.model_dir / "transformer"),
        "fp8 transformer": plain_read(args.fp8_dir / "transformer"),
    }
    outputs, transformers = {}, {}
    for name, path in (("quantized at start", args.model_dir), ("fp8 folder", args.fp8_dir)):
        pipeline, seconds, phases = load(path, name)
        outputs[name] = forward(pipeline.pipe.transformer).float().cpu()
        transformers[name] = pipeline.pipe.transformer
        result[name] = {"load_s": seconds, "phases_s": phases}
        del pipeline
    result["tensors_that_differ"] = differing_tensors(*transformers.values())
    a, b = outputs.values()
    result["forward_equal"] = bool(torch.equal(a, b))
    result["forward_max_abs_diff"] = float((a - b).abs().max())
    lines = [
        f"# FP8 folder against quantizing at the start: {args.arch}, one rank",
        "",
        f"GPUs: {', '.join(result['environment']['gpus'])}",
        f"Command: `{result['environment']['command']}`",
        "",
        *([f"- `ray-hsdp quantize` (host, bf16 to FP8): {result['quantize_s']} s"] if "quantize_s" in result else []),
        *[
            f"- plain read of the {k} files (8 threads, page cache): {v['bytes'] / 1e9:.1f} GB in {v['s']} s, "
            f"{v['GB/s']} GB/s"
            for k, v in result["plain_read"].items()
        ],  # fmt: skip
        f"- one transformer forward (81 frames at 832x480) of each: equal {result['forward_equal']}, "
        f"max abs diff {result['forward_max_abs_diff']}",
        f"- tensors of the two transformers that differ: {len(result['tensors_that_differ'])} "
        f"{result['tensors_that_differ'][:8]}",
        "",
        "| load | seconds | " + " | ".join(sorted({p for k in outputs for p in result[k]["phases_s"]})) + " |",
    ]
    phase_names = sorted({p for k in outputs for p in result[k]["phases_s"]})
    lines.append("| --- | --- | " + " | ".join("---" for _ in phase_names) + " |")
    for name in outputs:
        cells = [f"{result[name]['phases_s'].get(p, 0.0):.2f}" for p in phase_names]
        lines.append(f"| {name} | {result[name]['load_s']:.2f} | " + " | ".join(cells) + " |")
    write_results(args.out, args.name, result, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
