"""What FP8 linears do to one GPU's transformer forward, without sharding: bfloat16 against FP8
(activations scaled by fused kernels, as served, or eagerly), each also compiled.

    python -m bench.fp8 --out bench/results

A transformer of ``--arch``'s shape (Wan2.1-14B by default) with ``--layers`` blocks (random bf16
weights), one forward at 832x480 for each frame count; each setup's median time over ``--repeats``
forwards after two warm-up forwards (compiled setups compile in their warm-up), and its output's
drift from bfloat16's (max and mean abs difference over bfloat16's max abs). Results are written
after every setup.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

#: (name, FP8 linears, how FP8 scales activations, compile the blocks)
SETUPS = [
    ("bf16", False, None, False),
    ("fp8", True, "fused", False),
    ("fp8-eager-scaling", True, "eager", False),
    ("bf16-compile", False, None, True),
    ("fp8-compile", True, "fused", True),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", default="wan2.1-t2v-14b", help="a Wan architecture of ray_hsdp.checkpoints")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--frames", type=int, nargs="+", default=[21, 81])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--setups", nargs="+", default=[s[0] for s in SETUPS])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="bench/results")
    return parser


def markdown(rows: list[dict], args, environment: dict) -> str:
    lines = [
        f"# FP8 linears on one GPU: a {args.arch}-shaped transformer of {args.layers} blocks, 832x480",
        "",
        f"GPUs: {', '.join(environment['gpus']) or 'none'}",
        "",
        "| setup | frames | tokens | forward ms (median) | vs bf16 | drift from bf16: max / mean (of bf16's max abs) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['setup']} | {r['frames']} | {r['tokens']} | {r['forward_ms']:.1f} | {r['vs_bf16']:.3f} "
            f"| {r['drift_max']:.4f} / {r['drift_mean']:.5f} |"
        )
    return "\n".join([*lines, "", f"Command: `{environment['command']}`", ""])


def forward_inputs(base, frames: int, tiny: bool, device: str, dtype) -> tuple[dict, int]:
    """One forward's random inputs at 832x480 (32x32 on a CPU dry run) and ``frames``, and its tokens."""
    import torch

    latent_frames = (frames - 1) // 4 + 1
    height, width = (480, 832) if not tiny else (32, 32)
    generator = torch.Generator("cpu").manual_seed(1)
    channels = base.config.in_channels
    inputs = {
        "hidden_states": torch.randn(1, channels, latent_frames, height // 8, width // 8, generator=generator),
        "encoder_hidden_states": torch.randn(1, 512, base.config.text_dim, generator=generator),
        "timestep": torch.tensor([500]),
    }
    inputs = {k: v.to(device, dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}
    return inputs, latent_frames * (height // 16) * (width // 16)


def model_of(base, fp8: bool, scaling: str | None, compiled: bool):
    """A copy of ``base`` with the setup's FP8 linears (and their activation scaling) and compile."""
    from ray_hsdp.sharding import resolve_plan
    from ray_hsdp.sharding.fp8 import fp8_linears, quantize_fp8, scale_rows

    model = copy.deepcopy(base)
    if fp8:
        fp8_linears(resolve_plan(model, min_num_params=10**12))
        quantize_fp8(model)
        if scaling == "eager":
            for module in model.modules():
                if hasattr(module, "scale_rows"):
                    module.scale_rows = scale_rows
    if compiled:
        model.compile_repeated_blocks()
    return model


def timed_forwards(model, inputs: dict, repeats: int, device: str):
    """The median seconds of ``repeats`` forwards after two warm-up ones, and the last output."""
    import torch

    times = []
    with torch.no_grad():
        for i in range(2 + repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            output = model(**inputs, return_dict=False)[0]
            if device == "cuda":
                torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - start)
    return statistics.median(times), output.float()


def main() -> None:
    args = build_parser().parse_args()

    import torch
    from diffusers import WanTransformer3DModel

    from bench.common import environment
    from ray_hsdp.checkpoints.architectures import get_architecture
    from ray_hsdp.checkpoints.random_weights import transformer_kwargs

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    tiny = args.device != "cuda"  # a CPU dry run: a small model of the same kind
    kwargs = transformer_kwargs(get_architecture(args.arch), tiny) | {"num_layers": args.layers}
    with torch.device(args.device):  # initialised where it runs: a CPU init of 1B weights takes long
        base = WanTransformer3DModel(**kwargs).to(dtype).eval()
    rows: list[dict] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for frames in args.frames:
        inputs, tokens = forward_inputs(base, frames, tiny, args.device, dtype)
        reference = None
        for name, fp8, scaling, compiled in (setup for setup in SETUPS if setup[0] in args.setups):
            model = model_of(base, fp8, scaling, compiled)
            forward, output = timed_forwards(model, inputs, args.repeats, args.device)
            reference = output if reference is None else reference
            scale, diff = reference.abs().max(), (output - reference).abs()
            bf16 = next((r for r in rows if r["frames"] == frames and r["setup"] == "bf16"), None)
            rows.append(
                {
                    "setup": name,
                    "frames": frames,
                    "tokens": tokens,
                    "forward_ms": forward * 1e3,
                    "vs_bf16": bf16["forward_ms"] / (forward * 1e3) if bf16 else 1.0,
                    "drift_max": float(diff.max() / scale),
                    "drift_mean": float(diff.mean() / scale),
                }
            )
            env = environment()
            payload = {"rows": rows, "environment": env, "layers": args.layers}
            (out / "fp8-linears.json").write_text(json.dumps(payload, indent=1))
            (out / "fp8-linears.md").write_text(markdown(rows, args, env))
            print(rows[-1], flush=True)
            del model


if __name__ == "__main__":
    main()
