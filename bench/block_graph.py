"""One forward of a transformer (Wan2.1-T2V-14B's, or ``--model qwen-image``) on one GPU, per setup:
its time, the graphs and graph breaks dynamo made of its compiled blocks, and (``--profile``) its
kernel time by kind.

The transformer is built at real size with random bf16 weights on the GPU (no checkpoint: a
forward's cost does not depend on the weights' values), fed the latents of a clip of ``--frames`` at
``--size`` (Wan: 81 frames at 832x480, 32,760 tokens, and a text of 512 tokens; Qwen-Image: one
1328x1328 image, 6,889 tokens, and a text of 128). Setups:

- ``plain``: diffusers' eager forward, torch's SDPA, bf16 (what a plain pipeline runs);
- ``sdpa-fp8``: FP8 linears (``sharding.fp8.Fp8Linear``), blocks compiled (``compile_forward``);
- ``sage-diffusers-fp8``: the same under diffusers' own ``sage`` backend (its kernel called bare);
- ``sage-op-fp8``: the same under ``sage`` through the custom op (``sharding.attention_ops``);
- ``sage-op-fp8-cdt``, ``-autotune``: the same with inductor's ``coordinate_descent_tuning`` or
  ``max_autotune`` (their compile time is the setup's ``warm_up_s``);
- ``sage-op-fp8-cudagraphs``: the same with each block's graph replayed as a CUDA graph (inductor's
  ``triton.cudagraphs``, what ``mode="reduce-overhead"`` sets);
- ``sage-op-fp8-realrope`` (Qwen-Image): the same with its rotary embedding applied in real
  arithmetic (``sharding.policies.qwen_image.rotate_real``) instead of diffusers' complex product,
  which inductor leaves to eager kernels;
- ``sdpa-fp8-cudagraphs``, ``-realrope``...: those options under torch's SDPA (no kernel to build);
- ``fa3fp8-op-fp8``: FP8 linears and compile under ``fa3_fp8`` (FlashAttention 3's FP8 forward,
  built on the host by ``ray-hsdp build-kernels fa3``) through its custom op.

    python -m bench.block_graph --out bench/results --name block-graph-wan2.1-14b-1xH200 --profile
    python -m bench.block_graph --model qwen-image --out bench/results --name block-graph-qwen-image-1xH200
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ray_hsdp.sharding.apply import repeated_blocks

#: Wan2.1-T2V-14B's transformer (its config.json).
WAN_14B = dict(
    patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
)  # fmt: skip
#: Qwen-Image's transformer (its config.json).
QWEN_IMAGE = dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=3584, axes_dims_rope=(16, 56, 56),
)  # fmt: skip
#: Per model: its diffusers class, config, default size and how its layer count is named.
MODELS = {
    "wan2.1-14b": ("WanTransformer3DModel", WAN_14B, "832x480"),
    "qwen-image": ("QwenImageTransformer2DModel", QWEN_IMAGE, "1328x1328"),
}
SETUPS = (
    "plain", "sdpa-fp8", "sage-diffusers-fp8", "sage-op-fp8", "sage-op-fp8-cdt", "sage-op-fp8-autotune",
    "sage-op-fp8-cudagraphs", "sage-op-fp8-realrope", "sage-op-fp8-realrope-cudagraphs", "sdpa-fp8-cudagraphs",
    "sdpa-fp8-realrope", "sdpa-fp8-realrope-cudagraphs", "fa3fp8-op-fp8",
)  # fmt: skip
#: Inductor options of the setups that name them (the rest: inductor's defaults).
INDUCTOR = {
    "cdt": {"coordinate_descent_tuning": True},
    "autotune": {"max_autotune": True},
    "cudagraphs": {"triton.cudagraphs": True},
}
#: The kernel kinds of the table (``ray_hsdp.rank.profiling.KERNEL_KINDS``).
KINDS = ("attention", "matmul", "other")


def build(model_name: str, layers: int | None, device: str) -> torch.nn.Module:
    import diffusers

    class_name, config, _ = MODELS[model_name]
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(diffusers, class_name)(**{**config, "num_layers": layers or config["num_layers"]})
    return model.to(torch.bfloat16).eval().requires_grad_(False)


def inputs(model_name: str, frames: int, width: int, height: int, device: str) -> tuple[dict, int]:
    """A forward's inputs, and its image or video tokens."""
    gen = torch.Generator(device).manual_seed(1)
    bf16 = dict(generator=gen, device=device, dtype=torch.bfloat16)
    if model_name == "qwen-image":  # packed 2x2 patches of the 16-channel latents, one frame
        grid = (1, height // 16, width // 16)
        feed = {
            "hidden_states": torch.randn(1, grid[1] * grid[2], 64, **bf16),
            "encoder_hidden_states": torch.randn(1, 128, 3584, **bf16),
            "timestep": torch.tensor([0.5], device=device),
            "img_shapes": [grid],
        }
        return {**feed, "return_dict": False}, grid[1] * grid[2]
    latent = (1, 16, (frames - 1) // 4 + 1, height // 8, width // 8)
    feed = {
        "hidden_states": torch.randn(latent, **bf16),
        "timestep": torch.tensor([500], device=device),
        "encoder_hidden_states": torch.randn(1, 512, 4096, **bf16),
    }
    return {**feed, "return_dict": False}, latent[2] * (height // 16) * (width // 16)


def to_fp8(model: torch.nn.Module) -> int:
    """The blocks' linears in FP8, as a rank with ``quantization: fp8`` holds them."""
    from ray_hsdp.sharding.fp8 import Fp8Linear

    swapped = 0
    for block in repeated_blocks(model):
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear and not child.in_features % 16 and not child.out_features % 16:
                    fp8 = Fp8Linear.like(child)
                    fp8.quantize_()
                    setattr(parent, name, fp8)
                    swapped += 1
    return swapped


#: diffusers' own Qwen-Image rotation, kept before a ``-realrope`` setup replaces it in its module.
DIFFUSERS_ROPE: dict = {}


def set_rope(setup: str) -> None:
    """Qwen-Image's rotary embedding in real arithmetic for ``-realrope`` (its policy's ``traceable``
    step, as a rank takes it), diffusers' own otherwise."""
    from diffusers.models.transformers import transformer_qwenimage

    from ray_hsdp.sharding.policies import qwen_image

    DIFFUSERS_ROPE.setdefault("rotate", transformer_qwenimage.apply_rotary_emb_qwen)
    if "realrope" in setup:
        qwen_image.QWEN_IMAGE_TRANSFORMER.traceable()
    else:
        transformer_qwenimage.apply_rotary_emb_qwen = DIFFUSERS_ROPE["rotate"]


def set_backend(model: torch.nn.Module, setup: str) -> None:
    from ray_hsdp.sharding.context_parallel import keep_cross_attention_native, set_attention_backend

    set_rope(setup)
    if setup.startswith(("sage-op", "fa3fp8-op")):  # as a rank sets them: each kernel through its op
        set_attention_backend(model, "sage" if setup.startswith("sage") else "fa3_fp8")
    elif setup.startswith("sage-diffusers"):
        from diffusers.models import attention_dispatch as dispatch

        dispatch._AttentionBackendRegistry._backends[dispatch.AttentionBackendName.SAGE] = dispatch._sage_attention
        model.set_attention_backend("sage")
    else:
        model.reset_attention_backend()
    if setup.startswith("sage"):
        keep_cross_attention_native(model)  # as a rank does (attention_backends.PER_CHANNEL_V_BACKENDS)


def compile_blocks(model: torch.nn.Module) -> None:
    from ray_hsdp.sharding.apply import compile_forward

    for block in repeated_blocks(model):
        block.__dict__.pop("forward", None)  # the class's forward again
        compile_forward(block)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(model, feed: dict, repeats: int) -> list[float]:
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            _sync()
            start = time.perf_counter()
            model(**feed)
            _sync()
            times.append(time.perf_counter() - start)
    return times


def top_kernels(trace: dict, kind: str, count: int = 8) -> dict[str, float]:
    """The ``count`` kernels of ``kind`` that took the most time, by name (summed seconds)."""
    from collections import Counter

    from ray_hsdp.rank.profiling import kernel_kind

    seconds: Counter = Counter()
    for event in trace.get("traceEvents", []):
        if event.get("cat") == "kernel" and "dur" in event and kernel_kind(event["name"]) == kind:
            seconds[event["name"][:100]] += event["dur"] / 1e6
    return {name: round(s, 4) for name, s in seconds.most_common(count)}


def profiled(model, feed: dict) -> dict:
    """Kernel time by kind over one forward (``ray_hsdp.rank.profiling.kernel_summary``), and the
    kernels outside attention and GEMMs that took the most."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from ray_hsdp.rank.profiling import kernel_summary

    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        model(**feed)
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.loads(Path(trace.name).read_text())
    return {**kernel_summary(events), "top_other": top_kernels(events, "other")}


def run_setup(model, feed: dict, setup: str, repeats: int, profile: bool) -> dict:
    import torch._inductor.config
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    set_backend(model, setup)
    compiled = setup != "plain"
    if compiled:
        compile_blocks(model)
    options = INDUCTOR.get(setup.rsplit("-", 1)[-1], {})
    with torch._inductor.config.patch(**options):
        start = time.perf_counter()
        first = timed(model, feed, 2)  # with compile: the traces and compiles
        warm_s = time.perf_counter() - start
        times = timed(model, feed, repeats)
    row = {
        "setup": setup,
        "forward_s": round(statistics.median(times), 4),
        "forward_s_all": [round(t, 4) for t in times],
        "first_two_s": [round(t, 4) for t in first],
        "warm_up_s": round(warm_s, 1),
        "graphs": int(counters["stats"]["unique_graphs"]) if compiled else None,
        "graph_breaks": int(sum(counters["graph_break"].values())) if compiled else None,
        "graph_break_reasons": {k[:160]: v for k, v in counters["graph_break"].most_common(3)},
    }
    if profile:
        row["kernels"] = profiled(model, feed)
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="wan2.1-14b", choices=sorted(MODELS))
    parser.add_argument("--layers", type=int, default=None, help="default: the model's")
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--size", default=None, help="default: the model's (Wan 832x480, Qwen-Image 1328x1328)")
    parser.add_argument("--setups", nargs="+", default=list(SETUPS[:4]), choices=SETUPS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="block-graph")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the plain and sdpa setups")
    args = parser.parse_args(argv)
    size = args.size or MODELS[args.model][2]
    width, height = (int(x) for x in size.split("x"))
    model = build(args.model, args.layers, args.device)
    feed, tokens = inputs(args.model, args.frames, width, height, args.device)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (dry run)"
    meta = {"gpu": gpu, "torch": torch.__version__, "model": args.model, "layers": len(repeated_blocks(model)),
            "frames": args.frames, "size": size, "tokens": tokens}  # fmt: skip
    rows = []
    args.out.mkdir(parents=True, exist_ok=True)
    for setup in args.setups:
        if setup != "plain" and not any(r["setup"] != "plain" for r in rows):
            meta["fp8_linears"] = to_fp8(model)
        rows.append(run_setup(model, feed, setup, args.repeats, args.profile))
        print(json.dumps(rows[-1]), flush=True)
        (args.out / f"{args.name}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    lines = [f"# One forward of {args.model}'s transformer, {tokens} tokens, on one {meta['gpu']}", "",
             f"`python -m bench.block_graph --model {args.model} --out {args.out} --name {args.name}"
             f"{' --profile' if args.profile else ''}` (torch {meta['torch']}; random bf16 weights)", "",
             "| setup | forward s | graphs | graph breaks | attention kernels s | GEMM kernels s | other kernels s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in rows:
        kinds = (r.get("kernels") or {}).get("by_kind", {})
        kernel = [
            f"{kinds.get(k, {}).get('kernel_s', 0):.3f}" if kinds else "" for k in ("attention", "matmul", "other")
        ]
        lines.append(
            f"| {r['setup']} | {r['forward_s']:.3f} | {r['graphs']} | {r['graph_breaks']} | "
            + " | ".join(kernel)
            + " |"
        )
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
