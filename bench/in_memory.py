"""One request through plain diffusers with a real-size architecture built in GPU memory, for a model
whose checkpoint does not fit the host's disk (FLUX.2-dev: 112 GB of bf16 weights, a 64 GiB disk).

    python -m bench.in_memory --arch flux.2-dev --size 1024x1024 --steps 8 --guidance 4

The transformer and the real-size text encoder are built in bf16 straight on the GPU with random
weights (diffusers' and transformers' own initialisation), the VAE at its real size; the tokenizer is
the stand-in one. No checkpoint is written, so no group runs here (a group loads a folder): this
measures what one GPU holds for the whole model and one request's time and peak, against which the
computed weights per GPU of a group (``bench.weights``) stand.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench.common import environment, gib, write_results


def build(arch_name: str):
    """The pipeline of ``arch_name`` at real size on the GPU, in bf16, with random weights."""
    import diffusers
    import torch

    from ray_hsdp.checkpoints.architectures import get_architecture
    from ray_hsdp.checkpoints.chat_standins import CHAT_STANDINS
    from ray_hsdp.checkpoints.real_parts import REAL_PARTS

    arch = get_architecture(arch_name)
    small = CHAT_STANDINS[arch.family](
        get_architecture(arch_name).tiny | {"in_channels": arch.transformer["in_channels"]}
    )
    whole, large = REAL_PARTS[arch.family](arch.transformer)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            transformer = getattr(diffusers, arch.transformer_class)(**arch.transformer)
            encoders = {name: cls(config) for name, (cls, config) in large.items()}
    finally:
        torch.set_default_dtype(torch.float32)
    parts = {**small, **{k: v.to("cuda", torch.bfloat16) for k, v in whole.items()}, **encoders}
    pipe = getattr(diffusers, arch.pipeline_class)(transformer=transformer, **parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def main() -> None:
    import torch

    from bench.reference import timed_frames
    from ray_hsdp.request import GenerationRequest

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="flux.2-dev")
    parser.add_argument("--size", default="1024x1024")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--guidance", type=float, default=4.0)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default=None)
    args = parser.parse_args()
    width, height = map(int, args.size.split("x"))
    start = time.perf_counter()
    pipe = build(args.arch)
    build_s = time.perf_counter() - start
    weights = torch.cuda.memory_allocated()
    request = GenerationRequest(
        prompt="A red fox runs through the snowy forest at dawn",
        width=width,
        height=height,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        seed=7,
    )
    frames, request_s, peak = timed_frames(pipe, request)
    payload = {
        "arch": args.arch,
        "environment": environment(),
        "command": "python -m bench.in_memory " + " ".join(sys.argv[1:]),
        "build_s": round(build_s, 1),
        "weights_bytes": weights,
        "request_s": round(request_s, 2),
        "peak_bytes": peak,
        "finite": bool(torch.isfinite(torch.from_numpy(frames)).all()),
    }
    gpu = ", ".join(payload["environment"]["gpus"])
    text = (
        f"# {args.arch} at real size, built in GPU memory, plain diffusers\n\nGPU: {gpu}\n"
        f"Command: `{payload['command']}`\n\n"
        f"Weights on the GPU: {gib(weights)} GiB (random bf16; the stand-in tokenizer). One request, "
        f"{args.size}, {args.steps} steps, guidance {args.guidance}: {payload['request_s']} s, peak "
        f"{gib(payload['peak_bytes'])} GiB; frames finite: {payload['finite']}.\n"
    )
    write_results(args.out, args.name or f"in-memory-{args.arch}", payload, text)


if __name__ == "__main__":
    main()
