"""Which features may meet: the one table of the pairs a deployment or a request is refused for.

Every pair of a group-level setting and another setting, or a request-level choice, either runs
and equals its reference (``tests/test_pairs.py`` runs them by the dozen) or is listed here and
refused before any rank runs, with a message that names both and what to do instead.
``docs/pairs.md`` prints this table (``python -m ray_hsdp.config.pairs`` writes it).

Config rows are checked when a ``GroupConfig`` is built and again once its device is resolved;
request rows when a request reaches its group, which knows the pipeline's facts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ray_hsdp.config.kernels import CPU_BACKENDS, MASKLESS_BACKENDS, RING_BACKENDS
from ray_hsdp.request import InvalidRequestError


@dataclass(frozen=True)
class Refusal:
    """One pair that cannot meet.

    Attributes:
        first: The group-level setting, as a user writes it.
        second: The setting or request-level choice it cannot meet.
        reason: Why not.
        instead: What to do instead.
        refuses: Whether a config (config rows), a ``(config, facts, request)`` (request rows) or the
            facts of a model a group loads (model rows) hold the pair.
        scope: ``"config"``: refused at start; ``"model"``: refused at start, once the ranks see
            the model; ``"request"``: the request is refused (HTTP 400).
    """

    first: str
    second: str
    reason: str
    instead: str
    refuses: Callable[..., bool]
    scope: str = "config"

    @property
    def message(self) -> str:
        return f"{self.first} with {self.second}: {self.reason}; {self.instead}"


def _attention_outside(config, backends: tuple[str, ...]) -> bool:
    """Whether the config names an attention backend outside ``backends`` (of
    ``ray_hsdp.config.kernels``); ``auto`` picks one inside."""
    return config.attention_backend != "auto" and config.attention_backend not in backends


def _lane_size(config) -> int:
    """The widest lane a request of the group may run on."""
    return max((config.parallel_dims().lane_size, *config.lane_sizes))


def _switched(config) -> bool:
    return bool(set(config.loras) - set(config.fuse_loras))


REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        "a transformer without a context-parallel plan (HunyuanVideo-1.5)",
        "lanes that split the sequence (ulysses_degree, ring_degree, or lane_sizes above a CFG pair)",
        "diffusers splits a model's sequence only where its _cp_plan (or its sharding policy) says, and "
        "HunyuanVideo-1.5's joint attention builds a mask over the whole sequence that a split cannot take",
        "serve it in batch (lanes of one rank), or with cfg_parallel alone",
        lambda facts: facts.get("splits_sequence", False) and not facts["context_parallel_plan"],
        scope="model",
    ),
    Refusal(
        "a transformer whose blocks diffusers' First Block Cache does not know (HunyuanVideo-1.5)",
        "the cache kind first_block",
        "First Block Cache reads each block's outputs as diffusers' registry of transformer blocks says, "
        "and this model's block class has no entry there",
        "use the cache kind taylorseer, or none",
        lambda facts: facts.get("cache") == "first_block" and facts.get("cache_blocks_known") is False,
        scope="model",
    ),
    Refusal(
        "a pipeline that enters no cache context (FLUX.2)",
        "a step cache (cache kind)",
        "diffusers' step caches keep their state per cache context, which a pipeline enters around each "
        "forward; this one enters none, so no step cache runs on it (in diffusers either)",
        "use the cache kind none",
        lambda facts: facts.get("cache", "none") != "none" and facts.get("cache_context") is False,
        scope="model",
    ),
    Refusal(
        "a transformer whose attention always gets a mask (HunyuanVideo-1.5)",
        "an attention_backend whose kernels take no mask (sage and its variants, flash, _flash_3, _native_flash, "
        "fa3_fp8)",
        "those kernels raise on an attention mask, so the first forward would fail",
        "use attention_backend auto or native (torch's SDPA takes the mask)",
        lambda facts: facts.get("masks_attention", False) and facts.get("attention_backend") in MASKLESS_BACKENDS,
        scope="model",
    ),
    Refusal(
        "lane_widening",
        "cfg_parallel",
        "a widened forward runs on the wider lane's Ulysses ranks, while a CFG lane's halves exchange their "
        "predictions over the request's own lane",
        "leave lane_widening off, or cfg_parallel",
        lambda c: c.lane_widening and c.cfg_parallel,
    ),
    Refusal(
        "lane_widening",
        "a step cache (cache kind)",
        "a step cache keeps its state on the request's own ranks, and the ranks that help a widened forward "
        "hold none to decide a skip with",
        "leave lane_widening off, or the cache kind 'none'",
        lambda c: c.lane_widening and c.cache.kind != "none",
    ),
    Refusal(
        "lanes of several ranks (ulysses_degree, ring_degree, cfg_parallel)",
        "a sharded VAE (shard_components names 'vae')",
        "only a lane's leader decodes, so a sharded VAE's gathers would wait for ranks that never join them",
        "leave 'vae' out of shard_components (VAEs stay replicated) or use lanes of one rank",
        lambda c: _lane_size(c) > 1 and "vae" in c.shard_components,
    ),
    Refusal(
        "lanes of several ranks (ulysses_degree, ring_degree, cfg_parallel, or mode 'replicated')",
        "max_forward_batch > 1",
        "the ranks of a lane must run the very same call at every tick, so they run one call per forward",
        "set max_forward_batch 1",
        lambda c: _lane_size(c) > 1 and c.max_forward_batch > 1,
    ),
    Refusal(
        "ring_degree > 1",
        "device 'cpu'",
        "ring attention merges partial results by their log-sum-exp, which only the CUDA attention backends "
        "return (_native_cudnn, _native_flash)",
        "use ulysses_degree on CPU, or run on CUDA GPUs",
        lambda c: c.ring_degree > 1 and c.device == "cpu",
    ),
    Refusal(
        "attention_backend naming a CUDA kernel (sage, flash, _native_cudnn, ...)",
        "device 'cpu'",
        "its kernels run on CUDA GPUs only",
        "use attention_backend 'auto' or one of native, _native_math on CPU, or run on CUDA GPUs",
        lambda c: c.device == "cpu" and _attention_outside(c, CPU_BACKENDS),
    ),
    Refusal(
        "ring_degree > 1",
        "attention_backend other than auto, _native_cudnn, _native_flash (e.g. sage)",
        "ring attention merges partial results by their log-sum-exp, and ring lanes run only with the backends "
        "checked to return it here",
        "use ulysses_degree with that backend, or attention_backend 'auto' with ring_degree",
        lambda c: c.ring_degree > 1 and _attention_outside(c, RING_BACKENDS),
    ),
    Refusal(
        "vae_tiling 'on'",
        "vae_parallel 'rows'",
        "the row split shares the whole, untiled decode: the frames would not be the tiled decode's",
        "use vae_parallel 'on' to share a tiled decode's tiles, or vae_tiling 'auto' or 'off' with 'rows'",
        lambda c: c.vae_tiling == "on" and c.vae_parallel == "rows",
    ),
    Refusal(
        "gather 'in_place'",
        "reshard_after_forward False",
        "in-place gathers free each unit's gathered weights after its forward (its buffers take turns)",
        "use gather 'fsdp2', or mode 'replicated' to keep whole weights",
        lambda c: c.gather == "in_place" and not c.reshard_after_forward,
    ),
    Refusal(
        "switched loras (loras not in fuse_loras)",
        "compile",
        "an adapter switch between two forwards would recompile the blocks",
        "serve them uncompiled, or merge them into the weights with fuse_loras",
        lambda c: _switched(c) and c.compile,
    ),
    Refusal(
        "switched loras (loras not in fuse_loras)",
        "shard_size 1 with requests_per_rank > 1",
        "an unsharded rank runs its requests' forwards on their own threads, so two requests could not hold "
        "different adapters",
        "use requests_per_rank 1, or shard_size >= 2",
        lambda c: _switched(c) and c.resolved_shard_size == 1 and c.requests_per_rank > 1,
    ),
    Refusal(
        "switched loras (loras not in fuse_loras)",
        "quantization 'fp8'",
        "an adapter added after the FP8 swap takes the FP8 weight's dtype (PEFT casts it), loses its small "
        "values and has no FP8 matmul to run",
        "merge the adapters into the weights with fuse_loras (merged before the quantization), or use "
        "quantization 'none'",
        lambda c: _switched(c) and c.quantization == "fp8",
    ),
    Refusal(
        "quantization 'fp8'",
        "device 'cpu'",
        "FP8 needs a CUDA GPU with FP8 tensor cores (compute capability 8.9 or above: H100, L40S); on CPU FP8 "
        "matmuls are emulated and slower than float32",
        "use quantization 'none'",
        lambda c: c.quantization == "fp8" and c.device == "cpu",
    ),
    Refusal(
        "quantization 'fp8'",
        "gather 'fsdp2' or reshard_after_forward False on shard_size >= 2",
        "FP8 quantizes each rank's rows of the weights and gathers them in place",
        "use gather 'auto' or 'in_place' (with reshard_after_forward), or shard_size 1 (every rank whole)",
        lambda c: (
            c.quantization == "fp8"
            and c.resolved_shard_size > 1
            and (c.gather == "fsdp2" or not c.reshard_after_forward)
        ),
    ),
    Refusal(
        "a step cache (cache.kind)",
        "shard_size 1",
        "a step cache keeps each request's state apart on the tick thread of a sharded rank, which an unsharded "
        "rank does not have",
        "use shard_size >= 2",
        lambda c: c.cache.kind != "none" and c.resolved_shard_size == 1,
    ),
    Refusal(
        "a one-expert model",
        "guidance_scale_2",
        "guidance_scale_2 is the low-noise expert's guidance of a two-expert pipeline (Wan2.2 A14B)",
        "use guidance_scale",
        lambda c, facts, r: r.guidance_scale_2 is not None and not facts.get("guidance_scale_2"),
        scope="request",
    ),
    Refusal(
        "a one-expert model",
        "boundary_ratio",
        "boundary_ratio is where a two-expert pipeline (Wan2.2 A14B) hands the steps to its low-noise expert",
        "leave boundary_ratio out",
        lambda c, facts, r: r.boundary_ratio is not None and not facts.get("guidance_scale_2"),
        scope="request",
    ),
    Refusal(
        "a scheduler without a static shift (none, or use_dynamic_shifting as FLUX.1's and Qwen-Image's)",
        "a request's sample_solver",
        "both solvers run at the pipeline's static shift, which this scheduler does not have",
        "leave sample_solver out",
        lambda c, facts, r: r.sample_solver is not None and not facts.get("flow_shift"),
        scope="request",
    ),
    Refusal(
        "a scheduler without a static shift (none, or use_dynamic_shifting as FLUX.1's and Qwen-Image's)",
        "sample_solver",
        "both solvers run at the pipeline's static shift, which this scheduler does not have",
        "leave sample_solver out (the pipeline's own scheduler runs)",
        lambda facts: facts.get("sample_solver") is not None and not facts.get("scheduler_shift"),
        scope="model",
    ),
    Refusal(
        "sample_solver unipc (the request's or the deployment's)",
        "sigmas",
        "UniPC spaces its own steps and takes no schedule of a request's",
        "use sample_solver euler, or leave sigmas out",
        lambda c, facts, r: r.sigmas is not None and (r.sample_solver or c.sample_solver) == "unipc",
        scope="request",
    ),
    Refusal(
        "a scheduler other than diffusers' flow-match Euler (Wan's UniPC)",
        "sigmas",
        "only the flow-match Euler scheduler takes a schedule of sigmas",
        "add sample_solver euler (the request's or the deployment's), or leave sigmas out",
        lambda c, facts, r: (
            r.sigmas is not None and (r.sample_solver or c.sample_solver) is None and not facts.get("euler")
        ),
        scope="request",
    ),
    Refusal(
        "a text-to-video or text-to-image model",
        "a conditioning image (input_reference)",
        "the model makes its output from text alone",
        "send no image, or serve an image-to-video model",
        lambda c, facts, r: r.image is not None and not (facts.get("image_input") or facts.get("image_reference")),
        scope="request",
    ),
    Refusal(
        "a scheduler that stretches its schedule to a terminal shift (Qwen-Image)",
        "num_inference_steps 1",
        "its one-step schedule divides by zero and every frame comes out NaN (diffusers' own pipeline too)",
        "send num_inference_steps 2 or more",
        lambda c, facts, r: r.num_inference_steps < facts.get("min_steps", 1),
        scope="request",
    ),
    Refusal(
        "a model whose pipeline takes no negative prompt (FLUX.2)",
        "negative_prompt",
        "the pipeline would ignore it (FLUX.2 guides by a distilled guidance embedding, with no unconditional pass)",
        "leave negative_prompt out",
        lambda c, facts, r: r.negative_prompt is not None and facts.get("negative_prompt") is False,
        scope="request",
    ),
    Refusal(
        "a pipeline whose call takes no height and width (HunyuanVideo-1.5's image-to-video: its output size "
        "follows the input image)",
        "a request's size",
        "the pipeline would drop it and make the size it picks for the image",
        "leave size out: the output takes the size the model picks for the image (the video's record says it)",
        lambda c, facts, r: r.size_given and facts.get("size") is False,
        scope="request",
    ),
    Refusal(
        "a model whose pipeline loads no LoRA (HunyuanVideo-1.5)",
        "a request's lora",
        "diffusers has no LoRA loader for this pipeline, so no adapter can be registered for it",
        "leave lora out",
        lambda c, facts, r: bool(r.lora) and facts.get("lora") is False,
        scope="request",
    ),
    Refusal(
        "a scheduler without a static shift (none, or use_dynamic_shifting as FLUX.1's)",
        "flow_shift",
        "the scheduler would ignore it (a dynamic shift follows the image size)",
        "leave flow_shift out",
        lambda c, facts, r: r.flow_shift is not None and not facts.get("flow_shift"),
        scope="request",
    ),
    Refusal(
        "fuse_loras",
        "a request naming a fused adapter (lora)",
        "a merged adapter runs in every request at its fused scale",
        "leave it out of lora",
        lambda c, facts, r: any(name in c.fuse_loras for name, _ in r.lora),
        scope="request",
    ),
    Refusal(
        "fixed lanes (no lane_sizes)",
        "a request's lane_size",
        "the group's lanes are fixed at start",
        "leave lane_size out, or serve with lane_sizes",
        lambda c, facts, r: r.lane_size is not None and not c.lane_sizes,
        scope="request",
    ),
    Refusal(
        "a group's cache kind (or none)",
        "a request's step cache of another kind",
        "a group loads the hooks of one cache kind at start",
        "send cache 'off', or settings of the group's kind",
        lambda c, facts, r: r.cache is not None and r.cache.kind != c.cache.kind,
        scope="request",
    ),
)


def refuse_config(config) -> None:
    """Raises for the first config row that ``config`` holds.

    Raises:
        ValueError: Its message names both settings, why, and what to do instead.
    """
    for row in REFUSALS:
        if row.scope == "config" and row.refuses(config):
            raise ValueError(row.message)


def refuse_model(facts: dict[str, Any]) -> None:
    """Raises for the first model row that the ``facts`` of a model a group loads hold (``model``:
    its class name; ``splits_sequence``: the group's lanes split its sequence;
    ``context_parallel_plan``: it has a plan to split it by; ``cache``: the group's cache kind;
    ``cache_blocks_known``: diffusers' First Block Cache knows its blocks; ``cache_context``: its
    pipeline enters a cache context around each forward; ``attention_backend``: the group's;
    ``masks_attention``: its attention always gets a mask).

    Raises:
        ValueError: Its message names the model, both settings, why, and what to do instead.
    """
    for row in REFUSALS:
        if row.scope == "model" and row.refuses(facts):
            raise ValueError(f"{facts['model']}: {row.message}")


def refuse_request(config, facts: dict[str, Any], request) -> None:
    """Raises for the first request row that ``request`` on a group of ``config`` and
    ``facts`` (its pipeline's) holds.

    Raises:
        InvalidRequestError: Its message names both, why, and what to do instead (an HTTP 400).
    """
    for row in REFUSALS:
        if row.scope == "request" and row.refuses(config, facts, request):
            raise InvalidRequestError(row.message)


def markdown() -> str:
    """The table as ``docs/pairs.md`` prints it."""
    lines = ["| refused when | meets | why | instead | checked |", "| --- | --- | --- | --- | --- |"]
    for row in REFUSALS:
        checked = {"config": "at start", "model": "at start (the model's facts)"}.get(
            row.scope, "per request (HTTP 400)"
        )
        lines.append(f"| {row.first} | {row.second} | {row.reason} | {row.instead} | {checked} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
