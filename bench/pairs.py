"""Features meet in pairs: a group-level shape runs many requests at once, each with its own mix of
request-level choices, and each result is compared with its reference.

The CPU shapes run in ``tests/test_pairs.py`` against the unsharded diffusers pipeline at the
float level. The shapes a CPU cannot run (ring lanes, FP8, compile) run here on GPUs, where each
request is compared with the same request run alone on the same group (lock step with other
requests must not change a result) and, for the drift, with the unsharded pipeline in the same
dtype:

    python -m bench.pairs --out bench/results          # 2 GPUs: one group of 2 ranks per shape

Results: ``pairs-<gpu>.json`` / ``.md``, with the pairs (group-level setting, request-level choice)
each shape showed.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np

from bench.common import wait_until
from ray_hsdp.request import GenerationRequest, RequestCancelledError

GROUP_SETTINGS = (
    "batch",
    "ulysses lane",
    "ring lane",
    "cfg lane",
    "adaptive lanes",
    "keep_gathered",
    "vae_parallel",
    "vae_channels_last",
    "compile",
    "fp8",
    "several groups (autoscaling, takeover)",
    "cache kind",
    "fused adapters",
    "image-to-video model",
)
REQUEST_CHOICES = (
    "adapter",
    "several adapters",
    "adapter defaults",
    "cache on",
    "cache settings",
    "cache off",
    "flow_shift",
    "guidance_scale_2",
    "conditioning image",
    "timeout",
    "DELETE",
)

#: ``fused`` (the same file as ``detail``) is merged at load where a shape fuses it, else unused.
LORAS = {"style": "tiny-style", "detail": "tiny-detail", "fused": "tiny-detail"}
#: What a request naming an adapter gets for the fields it leaves out (a distilled adapter's); the
#: fused adapter's apply to every request of its group.
LORA_DEFAULTS = {"detail": {"num_inference_steps": 3, "flow_shift": 3.0}, "fused": {"flow_shift": 2.5}}


@dataclasses.dataclass(frozen=True)
class Mix:
    """One request: the body a client sends and the request-level choices it makes."""

    name: str
    body: dict
    choices: tuple[str, ...]


BASE = {"num_frames": 5, "size": "64x64"}  # 4 steps: the app's default_steps
#: The mixes every shape runs at once. Every request brings an image (the model needs one).
MIXES = (
    Mix("plain", {"prompt": "a cat on a roof", "seed": 1}, ("conditioning image", "cache off")),
    Mix("adapter", {"prompt": "a cat on a roof", "seed": 1, "lora": "style"}, ("adapter",)),
    Mix("two adapters", {"prompt": "rain", "seed": 2, "lora": "style:0.5,detail", "num_inference_steps": 4},
        ("several adapters",)),
    Mix("defaults", {"prompt": "a harbour", "seed": 3, "lora": "detail"}, ("adapter defaults",)),
    Mix("cache", {"prompt": "a cat on a roof", "seed": 1, "cache": "on"}, ("cache on",)),
    Mix("flow_shift", {"prompt": "waves", "seed": 4, "flow_shift": 2.0}, ("flow_shift",)),
    Mix("guidance_scale_2", {"prompt": "waves", "seed": 4, "guidance_scale_2": 2.0}, ("guidance_scale_2",)),
    Mix(
        "all",
        {"prompt": "a fox", "seed": 5, "lora": "style:0.7", "flow_shift": 3.0, "guidance_scale_2": 1.5},
        ("adapter", "flow_shift", "guidance_scale_2", "cache settings"),
    ),
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Shape:
    """One group-level shape: the group's fields and the settings it stands for."""

    name: str
    fields: dict
    settings: tuple[str, ...]
    #: The cache settings the "all" mix sends (of the group's kind).
    cache_settings: dict
    #: Requests at this size also run (vae_parallel: frames of several VAE tiles).
    large: str | None = None
    #: Adaptive lanes: the mixes' requests name these lane sizes in turn (``None``: the group chooses).
    lane_sizes: tuple[int | None, ...] = ()

    def request_fields(self, index: int) -> dict:
        """What the shape adds to its ``index``-th request's body."""
        lane_size = self.lane_sizes[index % len(self.lane_sizes)] if self.lane_sizes else None
        return {"lane_size": lane_size} if lane_size is not None else {}


CPU_SHAPES = (
    Shape(
        "batch",
        {"shard_size": 2, "requests_per_rank": 2, "keep_gathered": 0.5,
         "cache": {"kind": "taylorseer", "every_request": False}},
        ("batch", "keep_gathered", "cache kind", "image-to-video model"),
        {"interval": 3, "warmup_steps": 2},
    ),
    Shape(
        "cfg-ulysses",
        {"shard_size": 4, "ulysses_degree": 2, "cfg_parallel": True, "requests_per_rank": 2, "vae_parallel": "on",
         "vae_channels_last": True, "fuse_loras": {"fused": 0.5},
         "cache": {"kind": "first_block", "every_request": False}},
        ("ulysses lane", "cfg lane", "vae_parallel", "vae_channels_last", "fused adapters", "cache kind",
         "image-to-video model"),
        {"threshold": 1e9},  # no change reaches it: every step after the first reuses the cache
        large="320x288",
    ),
    # Lanes of one and two ranks side by side: every other request asks for a lane of 2, the rest
    # take what the group gives them (lanes of 1 under this backlog).
    Shape(
        "adaptive",
        {"shard_size": 2, "lane_sizes": [1, 2], "requests_per_rank": 2,
         "cache": {"kind": "first_block", "every_request": False}},
        ("adaptive lanes", "cache kind", "image-to-video model"),
        {"threshold": 1e9},
        lane_sizes=(2, None),
    ),
)  # fmt: skip
#: Two ranks each, bfloat16 (ring attention needs cuDNN's, which takes no float32).
GPU_SHAPES = (
    Shape(
        "ring",
        {"shard_size": 2, "ring_degree": 2, "requests_per_rank": 2,
         "cache": {"kind": "taylorseer", "every_request": False}},
        ("ring lane", "cache kind", "image-to-video model"),
        {"interval": 3, "warmup_steps": 2},
    ),
    Shape(
        "fp8",
        {"shard_size": 2, "quantization": "fp8", "requests_per_rank": 2, "fuse_loras": {"fused": 0.5},
         "loras": {"fused": "tiny-detail"}, "cache": {"kind": "first_block", "every_request": False}},
        ("fp8", "fused adapters", "cache kind", "image-to-video model"),
        {"threshold": 1e9},
    ),
    Shape(
        "compile",
        {"shard_size": 2, "compile": True, "requests_per_rank": 2, "fuse_loras": {"fused": 0.5},
         "loras": {"fused": "tiny-detail"}, "cache": {"kind": "taylorseer", "every_request": False}},
        ("compile", "fused adapters", "cache kind", "image-to-video model"),
        {"interval": 3, "warmup_steps": 2},
    ),
)  # fmt: skip


def app_config(folder: str, shape: Shape, device: str = "cpu", dtype: str = "auto"):
    """The shape's app config: the shared adapters and their defaults unless the shape names its own."""
    from ray_hsdp.config.app import AppConfig

    fields = {"loras": LORAS, **shape.fields}
    defaults = {name: d for name, d in LORA_DEFAULTS.items() if name in fields["loras"]}
    return AppConfig(model=folder, device=device, dtype=dtype, lora_defaults=defaults, default_steps=4, **fields)


def mixes_for(shape: Shape, config) -> list[Mix]:
    """The shape's mixes: the common ones with its cache settings (without the adapters the group
    does not switch), plus the large ones."""
    switched = set(config.lora_sources(fused=False))
    # A fused adapter's defaults apply to every request of the group.
    fused_defaults = ("adapter defaults",) if set(config.fuse_loras) & set(config.lora_defaults) else ()
    out = []
    for mix in MIXES:
        body = dict(mix.body)
        if mix.name == "all":
            body["cache"] = shape.cache_settings
        choices = mix.choices
        named = {part.split(":")[0] for part in str(body.get("lora", "")).split(",") if part}
        if named - switched:  # the group refuses switched adapters (compile, fp8): the rest of the mix runs
            body.pop("lora")
            choices = tuple(c for c in choices if c not in ("adapter", "several adapters", "adapter defaults"))
            if not choices:
                continue
        out.append(Mix(mix.name, body, tuple(dict.fromkeys(choices + fused_defaults))))
    if shape.large:
        out += [
            Mix(f"{m.name} {shape.large}", {**m.body, "size": shape.large, "num_frames": 1, "num_inference_steps": 2},
                m.choices)
            for m in out
            if m.name in ("adapter", "cache")
        ]  # fmt: skip
    return out


def build(config, mix: Mix, index: int, **fields) -> GenerationRequest:
    """The request a client's body makes on this app (defaults and limits applied), with float frames."""
    from bench.reference import random_png
    from ray_hsdp.serve.schema import VideoCreateRequest, to_video_request

    body = VideoCreateRequest(**{**BASE, **mix.body, **fields})
    body = body.model_copy(update={"input_reference": random_png(64, 48, index)})
    request, _ = to_video_request(body, config, 4, f"{mix.name}#{index}")
    return dataclasses.replace(request, uint8_frames=False)  # compared at the float level


def cut_and_cancelled(group, config) -> list[tuple[Mix, GenerationRequest]]:
    """A request cut off by its deadline and one cancelled (a DELETE's path) while running, each with
    an adapter where the group switches one and a cache; then a request under each one's id, which
    must start clean.

    Raises:
        AssertionError: Either did not end as it should.
    """
    lora = {"lora": "style"} if "style" in config.lora_sources(fused=False) else {}
    mix = Mix("long", {"prompt": "a long one", "seed": 9, "cache": "on", **lora}, ())
    # (timeout_s is an image request's field; a video job has the group's request_timeout_s.)
    cut = dataclasses.replace(build(config, mix, 90, num_inference_steps=200), timeout_s=1.0)
    try:
        group.submit(cut).result(timeout=120)
        raise AssertionError("a request past its deadline completed")
    except TimeoutError as err:
        assert "missed its deadline" in str(err), err
    cancelled = build(config, mix, 91, num_inference_steps=200)
    future = group.submit(cancelled)
    wait_until(lambda: group.progress().get(cancelled.request_id, {}).get("step", 0) >= 1, 120, "the request runs")
    assert group.cancel(cancelled.request_id)
    try:
        future.result(timeout=120)
        raise AssertionError("a cancelled request completed")
    except RequestCancelledError:
        pass
    after = []
    choices = ("adapter",) if lora else ()
    for choice, gone in (("timeout", cut), ("DELETE", cancelled)):
        follow = Mix(f"after {choice}", mix.body, (choice, "cache on", *choices))
        after.append((follow, dataclasses.replace(build(config, follow, 92), request_id=gone.request_id)))
    return after


def run_shape(config, shape: Shape, alone: bool = False) -> list[tuple[Mix, GenerationRequest, np.ndarray, object]]:
    """One group of ``config`` runs the shape's mixes at once, then a cut and a cancelled request and
    a request under each one's id; with ``alone``, each request once more on its own.

    Returns:
        ``(mix, request, frames, frames alone or None)`` per request.
    """
    from ray_hsdp.group import ShardGroup

    mixes = mixes_for(shape, config)
    requests = [build(config, mix, i, **shape.request_fields(i)) for i, mix in enumerate(mixes)]
    started = time.monotonic()
    with ShardGroup(config) as group:
        results = group.generate(requests)
        after = cut_and_cancelled(group, config)
        after_results = group.generate([request for _, request in after])
        pairs = [*zip(mixes, requests), *after]
        frames = [r.frames for r in (*results, *after_results)]
        single = [group.generate([request])[0].frames if alone else None for _, request in pairs]
    print(f"{shape.name}: {len(pairs) + 2} requests in {time.monotonic() - started:.1f}s", flush=True)
    return [(mix, request, f, s) for (mix, request), f, s in zip(pairs, frames, single)]


def diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max())


def mean_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).mean())


def gpu_run(out_dir: Path, shapes: list[str], model_dir: Path) -> dict:
    """The GPU shapes on the tiny two-expert image-to-video model, bfloat16, two ranks each."""
    import torch

    from bench.common import environment, write_results
    from bench.reference import pipeline_with_adapters, reference_with
    from ray_hsdp.checkpoints.tiny import make_tiny

    folder = str(make_tiny(model_dir, two_experts=True, image_to_video=True, overwrite=True))
    rows, covered = [], set()
    gpu = torch.cuda.get_device_name(0).replace(" ", "-")
    payload = {"environment": environment(), "command": "python -m bench.pairs --out bench/results"}
    for shape in (s for s in GPU_SHAPES if s.name in shapes):
        config = app_config(folder, shape, device="cuda", dtype="bfloat16")
        ran = run_shape(config, shape, alone=True)
        # bfloat16 drifts from float32 on its own: the unsharded pipeline in both dtypes tells how far.
        pipe = pipeline_with_adapters(folder, dict(config.loras), dict(config.fuse_loras)).to("cuda", torch.bfloat16)
        exact = pipeline_with_adapters(folder, dict(config.loras), dict(config.fuse_loras)).to("cuda")
        for mix, request, frames, single in ran:
            bf16, fp32 = reference_with(pipe, request), reference_with(exact, request)
            row = {
                "shape": shape.name,
                "mix": mix.name,
                "choices": list(mix.choices),
                "vs_alone": diff(frames, single),
                "vs_unsharded_bf16": diff(frames, bf16),
                "mean_vs_unsharded_fp32": mean_diff(frames, fp32),
                "unsharded_bf16_mean_vs_fp32": mean_diff(bf16, fp32),
            }
            # Lock step with other requests must not change a result: at most one 8-bit level.
            row["equal"] = row["vs_alone"] <= 1 / 255
            rows.append(row)
            if row["equal"]:
                covered |= {(setting, choice) for setting in shape.settings for choice in mix.choices}
        del pipe, exact
        # Written after each shape: a later shape's failure keeps what the earlier ones showed.
        payload.update(rows=rows, pairs=sorted(covered))
        lines = [
            "| shape | mix | choices | max vs alone | max vs unsharded bf16 | mean vs unsharded fp32 "
            "| unsharded bf16: mean vs fp32 | equal |",
            "| --- " * 8 + "|",
        ]
        lines += [
            f"| {r['shape']} | {r['mix']} | {', '.join(r['choices'])} | {r['vs_alone']:.2e} "
            f"| {r['vs_unsharded_bf16']:.3f} | {r['mean_vs_unsharded_fp32']:.4f} "
            f"| {r['unsharded_bf16_mean_vs_fp32']:.4f} | {r['equal']} |"
            for r in rows
        ]
        write_results(out_dir, f"pairs-{torch.cuda.device_count()}x{gpu}", payload, "\n".join(lines) + "\n")
    return payload


def pairs_doc(where: dict[tuple[str, str], str]) -> str:
    """``docs/pairs.md``: where each pair of a group-level setting and a request-level choice runs,
    and the table of refusals (``ray_hsdp.config.pairs``)."""
    from ray_hsdp.config.pairs import markdown

    short = list(REQUEST_CHOICES)
    lines = [
        "# Features in pairs",
        "",
        "Every pair of a group-level setting (rows) and a request-level choice (columns) either runs and equals",
        "its reference, or is refused before any rank runs. Generated by `tests/test_pairs.py`",
        "(`RAY_HSDP_WRITE_DOCS=1`), which fails when this page is stale.",
        "",
        "- **CPU**: `tests/test_pairs.py` runs it (gloo, the tiny two-expert image-to-video model), many mixes at",
        "  once on one group, each equal to the unsharded diffusers pipeline with the same choices (<= 1e-5).",
        "- **GPU**: `python -m bench.pairs` on 2 GPUs (bf16; `bench/results/pairs-*.md`): each request equals",
        "  itself run alone on the same group, exactly; its mean drift from the unsharded float32 pipeline is that",
        "  of the unsharded bf16 pipeline (ring lanes, compile) or about twice it (FP8), listed there.",
        "- **HTTP**: the takeover test (`tests/serve/test_autoscaling.py`): a job moves whole to another group",
        "  and its first frame equals the unsharded pipeline's.",
        "- **refused**: by the table below, with a message that names both.",
        "",
        "| | " + " | ".join(short) + " |",
        "| --- " * (len(short) + 1) + "|",
    ]
    for setting in GROUP_SETTINGS:
        lines.append(f"| {setting} | " + " | ".join(where.get((setting, c), "-") for c in short) + " |")
    lines += ["", *model_choices(), ""]
    lines += [
        "## Refused pairs",
        "",
        "`ray_hsdp/config/pairs.py`, the one table both the config and the group check:",
        "",
    ]
    return "\n".join(lines) + "\n" + markdown()


#: The models of the per-model table: ``make-random``'s architecture, and the pipeline class a group
#: loads its folder as when not the one the folder names (``pipeline_class``).
MODEL_ROWS = (
    ("wan2.1-t2v-14b", None),
    ("wan2.1-i2v-14b", None),
    ("wan2.2-t2v-a14b", None),
    ("wan2.2-i2v-a14b", None),
    ("wan2.2-ti2v-5b", None),
    ("wan2.2-ti2v-5b", "WanImageToVideoPipeline"),
    ("qwen-image", None),
    ("flux.2-dev", None),
    ("hunyuanvideo-1.5", None),
    ("hunyuanvideo-1.5", "HunyuanVideo15ImageToVideoPipeline"),
    ("flux.1-dev", None),
)


def _step_caches(transformer, pipe_cls: type) -> list[str]:
    """The cache kinds a group's load lets ``transformer`` of a ``pipe_cls`` pipeline take."""
    from ray_hsdp.loading.start_checks import refuse_step_cache

    kinds = []
    for kind in ("first_block", "taylorseer"):
        try:
            refuse_step_cache(transformer, kind, pipe_cls)
            kinds.append(kind)
        except ValueError:
            pass
    return kinds


def model_choices() -> list[str]:
    """The per-model table of ``docs/pairs.md``: which request choices each model's pipeline takes,
    and how, from the pipeline classes (their call's arguments, their LoRA loader) and the registries
    of ``ray_hsdp.sharding`` (the pipeline calls, the transformers' policies)."""
    import inspect

    import diffusers

    from ray_hsdp.checkpoints.architectures import get_architecture
    from ray_hsdp.checkpoints.lora import transformer_on_meta
    from ray_hsdp.pipeline.args import call_takes
    from ray_hsdp.sharding import policies  # noqa: F401 (registers them)
    from ray_hsdp.sharding.pipeline_call import FIRST_FRAME, pipeline_call_for
    from ray_hsdp.sharding.policy import registered_policy

    lines = [
        "## Request choices per model",
        "",
        "What each served model's pipeline does with a request's choices (a choice it cannot take is refused",
        "per request, HTTP 400; a layout it cannot run, at start). Generated from the pipeline classes and",
        "`ray_hsdp/sharding/policies/`. A LoRA runs through diffusers' loader of the pipeline's family, equal",
        "to plain diffusers' adapters in the tests of Wan (`tests/test_loras.py`), Qwen-Image, FLUX.2 and",
        "TI2V-5B (`tests/test_model_*.py`); FLUX.1's is not tested.",
        "A step cache: the group's `cache.kind` values it runs (others are refused at start); Wan's tests run",
        "both, Qwen-Image's First Block Cache, TI2V-5B's and HunyuanVideo-1.5's TaylorSeer, each against",
        "diffusers' own hook on the unsharded pipeline.",
        "",
        "| model | pipeline | size | guidance_scale | negative_prompt | input_reference | lora | guidance_scale_2 "
        "| Ulysses / ring lanes | cfg_parallel | step cache (cache kind) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, override in MODEL_ROWS:
        arch = get_architecture(name)
        pipe_cls = getattr(diffusers, override or arch.pipeline_class)
        params = set(inspect.signature(pipe_cls.__call__).parameters)
        takes = call_takes(params)  # the choices its call takes, as a group's pipeline facts say
        call = pipeline_call_for(pipe_cls)
        model_cls = getattr(diffusers, arch.transformer_class)
        policy = registered_policy(model_cls)
        guidance = f"`{call.guidance}`" if call.guidance else "its guider"
        if "image" not in params:
            image = "refused"
        else:
            image = "first frame (required)" if call.image == FIRST_FRAME else "reference (optional)"
        plan = getattr(model_cls, "_cp_plan", None) is not None or (policy is not None and policy.cp_plan is not None)
        cells = [
            name,
            f"`{pipe_cls.__name__}`",
            "taken" if takes["size"] else "refused (follows the image)",
            guidance
            + (
                f" (negative `{call.negative_prompt_when_guided!r}` when none)"
                if call.negative_prompt_when_guided
                else ""
            ),
            "taken" if takes["negative_prompt"] else "refused",
            image,
            "taken" if hasattr(pipe_cls, "load_lora_weights") else "refused",
            "taken" if len(arch.experts) > 1 else "refused",
            "run" if plan else "refused",
            "run" if policy is not None and policy.cfg_split else "refused",
            ", ".join(_step_caches(transformer_on_meta(name, tiny=True), pipe_cls)) or "refused",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--shapes", nargs="+", default=[s.name for s in GPU_SHAPES])
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/pairs-wan22-i2v"))
    args = parser.parse_args()
    from bench.common import start_ray

    start_ray()
    payload = gpu_run(args.out, args.shapes, args.model_dir)
    failed = [r for r in payload["rows"] if not r["equal"]]
    print(f"{len(payload['rows'])} requests, {len(failed)} not equal to themselves alone: {failed}")


if __name__ == "__main__":
    main()
