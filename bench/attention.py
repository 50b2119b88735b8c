"""Attention kernels at Wan's shapes against torch's default SDPA, and one Wan transformer forward
per diffusers attention backend, with each one's drift from the default.

    python -m bench.attention --tokens 9360 32760 75600 --backends sage --forward-tokens 32760 75600

Kernels: ``q, k, v`` of ``--heads`` x ``--head-dim`` (Wan2.1-14B: 40 x 128) in bf16, one sequence
of each token count (832x480 at 21 frames is 9,360 tokens, at 81 frames 32,760; 1280x720 at 81
frames 75,600), timed with CUDA events (median of ``--repeats`` after ``--warmup`` calls); drift: max
and mean absolute difference of the output against SDPA's, beside SDPA's mean magnitude. Forward:
one ``--arch`` transformer built with random weights on the GPU (no checkpoint), one denoising
forward per backend (set as a group sets it: ``sharding.context_parallel.set_attention_backend``;
``native`` is diffusers' default), its
time and its output's drift from ``native``. Needs CUDA; ``sage`` needs the ``sageattention``
package (``docs/attention.md`` says how to build it), ``--kernels fa3 fa3-fp8`` and ``--backends
fa3_fp8`` FlashAttention 3's ``flash_attn_interface`` (the FP8 kernel as the project serves it).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from bench.common import environment, write_results


def timed(fn, warmup: int, repeats: int) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` calls after ``warmup``."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def fa3_kernels() -> dict:
    """FlashAttention 3 (the ``hopper/`` build: ``flash_attn_interface``), on ``(batch, heads,
    tokens, dim)`` inputs like the others: in bf16, and in FP8 as ``attention_backend: fa3_fp8``
    serves it (``ray_hsdp.sharding.fa3_fp8``: each head's mean key taken out, q, k and v scaled per
    (batch, head) to e4m3); the FP8 kernel's time includes that quantization, as a served forward
    pays it."""
    from flash_attn_interface import flash_attn_func

    from ray_hsdp.sharding import fa3_fp8

    fa3_fp8.register()

    def first(out):  # newer builds return (out, lse) when asked; older always did
        return out[0] if isinstance(out, tuple) else out

    def bf16(q, k, v):
        return first(flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)))).transpose(1, 2)

    def e4m3(q, k, v):
        return fa3_fp8.fa3_fp8_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)

    return {"fa3": bf16, "fa3-fp8": e4m3}


def kernel_rows(args) -> list[dict]:
    import torch
    import torch.nn.functional as F

    kernels = {"sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v)}
    if "sage" in args.backends + args.kernels:
        from sageattention import sageattn

        kernels["sage"] = lambda q, k, v: sageattn(q, k, v, tensor_layout="HND")
    if {"fa3", "fa3-fp8"} & set(args.kernels):
        kernels |= {name: fn for name, fn in fa3_kernels().items() if name in args.kernels}
    rows = []
    for tokens in args.tokens:
        gen = torch.Generator("cuda").manual_seed(tokens)
        qkv = [
            torch.randn(1, args.heads, tokens, args.head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(3)
        ]
        reference = kernels["sdpa"](*qkv).float()
        for name, kernel in kernels.items():
            out = kernel(*qkv).float()
            diff = (out - reference).abs()
            rows.append(
                {
                    "tokens": tokens,
                    "kernel": name,
                    "ms": round(timed(lambda kernel=kernel, qkv=qkv: kernel(*qkv), args.warmup, args.repeats), 3),
                    "max_abs_diff": round(diff.max().item(), 5),
                    "mean_abs_diff": round(diff.mean().item(), 6),
                    "mean_abs_sdpa": round(reference.abs().mean().item(), 5),
                }
            )
            print(rows[-1], flush=True)
        del qkv, reference
    return rows


def forward_rows(args) -> list[dict]:
    """One transformer forward per backend and token count (random weights built on the GPU)."""
    import torch
    from diffusers import WanTransformer3DModel

    from ray_hsdp.checkpoints.architectures import get_architecture
    from ray_hsdp.sharding.context_parallel import set_attention_backend

    arch = get_architecture(args.arch)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 on the GPU: fp32 first would not fit beside it
    with torch.device("cuda"):
        model = WanTransformer3DModel(**arch.transformer).eval()
    torch.set_default_dtype(torch.float32)
    rows = []
    for tokens in args.forward_tokens:
        # A 16-channel latent of 104 x 60 (832x480) or 160 x 90 (1280x720) per frame, patched 2 x 2.
        width, height = (160, 90) if tokens % 3600 == 0 else (104, 60)
        frames = tokens // (width * height // 4)
        gen = torch.Generator("cuda").manual_seed(1)
        channels, text_dim = model.config.in_channels, model.config.text_dim
        latents = torch.randn(1, channels, frames, height, width, device="cuda", dtype=torch.bfloat16, generator=gen)
        text = torch.randn(1, 512, text_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        timestep = torch.tensor([500], device="cuda")
        reference = None
        for backend in ["native", *args.backends]:
            set_attention_backend(model, backend)  # fa3_fp8 registered; cross-attentions kept on SDPA

            def forward(latents=latents, timestep=timestep, text=text):
                with torch.inference_mode():
                    return model(latents, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]

            out = forward().float()
            ms = timed(forward, 1, args.forward_repeats)
            row = {"tokens": tokens, "backend": backend, "forward_s": round(ms / 1000, 3)}
            if reference is None:
                reference = out
            else:
                diff = (out - reference).abs()
                row |= {"max_abs_diff": round(diff.max().item(), 5), "mean_abs_diff": round(diff.mean().item(), 6)}
            row["mean_abs_native"] = round(reference.abs().mean().item(), 5)
            rows.append(row)
            print(row, flush=True)
        model.set_attention_backend("native")
    return rows


def markdown(payload: dict) -> str:
    env = payload["environment"]
    lines = [
        f"# Attention at Wan's shapes: {payload['heads']} heads x {payload['head_dim']}, bf16",
        "",
        f"GPU: {', '.join(env['gpus'][:1])}; torch {env['torch']}, diffusers {env['diffusers']}.",
        f"Command: `{env['command']}`",
        "",
        "| tokens | kernel | ms | speed-up vs SDPA | max abs diff | mean abs diff | mean abs of SDPA |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    sdpa = {r["tokens"]: r["ms"] for r in payload["kernels"] if r["kernel"] == "sdpa"}
    for r in payload["kernels"]:
        lines.append(
            f"| {r['tokens']} | {r['kernel']} | {r['ms']} | {sdpa[r['tokens']] / r['ms']:.2f}x | "
            f"{r['max_abs_diff']} | {r['mean_abs_diff']} | {r['mean_abs_sdpa']} |"
        )
    if payload["forwards"]:
        native = {r["tokens"]: r["forward_s"] for r in payload["forwards"] if r["backend"] == "native"}
        lines += [
            "",
            f"One {payload['arch']} transformer forward (random weights):",
            "",
            "| tokens | backend | s | speed-up vs native | max abs diff | mean abs diff | mean abs of native |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in payload["forwards"]:
            lines.append(
                f"| {r['tokens']} | {r['backend']} | {r['forward_s']} | {native[r['tokens']] / r['forward_s']:.3f}x | "
                f"{r.get('max_abs_diff', '-')} | {r.get('mean_abs_diff', '-')} | {r['mean_abs_native']} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[9360, 32760, 75600])
    parser.add_argument("--heads", type=int, default=40)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--backends", nargs="*", default=["sage"], help="diffusers backends beside the default")
    parser.add_argument("--kernels", nargs="*", default=[], choices=["sage", "fa3", "fa3-fp8"],
                        help="kernels timed beside SDPA (fa3: FlashAttention 3's hopper build)")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--arch", default="wan2.1-t2v-14b")
    parser.add_argument("--forward-tokens", type=int, nargs="*", default=[32760])
    parser.add_argument("--forward-repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="attention")
    args = parser.parse_args()
    payload = {"arch": args.arch, "heads": args.heads, "head_dim": args.head_dim, "environment": environment()}
    payload["kernels"] = kernel_rows(args)
    payload["forwards"] = []
    write_results(args.out, args.name, payload, markdown(payload))
    if args.forward_tokens:
        payload["forwards"] = forward_rows(args)
        write_results(args.out, args.name, payload, markdown(payload))


if __name__ == "__main__":
    main()
