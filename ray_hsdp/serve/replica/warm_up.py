"""A replica's warm-up: the app's ``warm_up`` shapes run before its group serves (the request
built from the API's body, the loop on every lane; with a shape's ``decode``, also the VAE decode,
the uint8 frames and the response's encoding), so that a user's first request at a warmed shape
runs as fast as the second. What must run once per process is the transformer's first call at the
shape (torch.compile's tracing and its graphs' load, even from a full compile cache): the decode
and the encoding compile nothing, and their first run at the shape cost the first request about
0.1 s each on one H100 (81 frames at 832x480: first / second request 1.000 without them), which is
why a shape decodes only when asked. The group marks the runs as its warm-up: no record, metric,
lane time or video job counts them."""

from __future__ import annotations

import dataclasses
import logging

from ray_hsdp.config.app import AppConfig
from ray_hsdp.config.blocks import WarmUpShape
from ray_hsdp.group import Engine
from ray_hsdp.group.warm_up import gray_png
from ray_hsdp.loading.page_cache import read_ahead_in_background
from ray_hsdp.request import GenerationRequest, GenerationResult, parse_size
from ray_hsdp.serve.errors import RequestLimitError
from ray_hsdp.serve.media import encode_mp4, encode_png
from ray_hsdp.serve.schema import (
    ImageGenerationRequest,
    VideoCreateRequest,
    image_response,
    to_generation_request,
    to_video_request,
)

logger = logging.getLogger("ray_hsdp")

#: The warm-up's prompt: its text encoder's input shape is padded to a fixed length, as a user's.
PROMPT = "warm up"


def warm_up_request(shape: WarmUpShape, config: AppConfig, facts: dict, index: int) -> tuple[GenerationRequest, int]:
    """The request of one shape, built from an API body as a user's is, with the fewest steps that
    reach every expert (``warm_up_steps``), and the MP4's frame rate (0: an image, of an image model
    or, for a shape of one frame, of a video model's image route).

    Raises:
        ValueError: The shape is not one the model takes (the message names the shape and why).
    """
    image = gray_png(*parse_size(shape.size)) if facts.get("image_input") else None
    fields = {"prompt": PROMPT, "num_inference_steps": facts["warm_up_steps"], "seed": 0}
    if facts.get("size") is not False:  # else its output follows its image, which has the shape's size
        fields["size"] = shape.size
    request_id = f"warm-up-{index}"
    try:
        if facts.get("video") and shape.num_frames != 1:  # one frame: the image route's request
            t = facts["temporal_compression"]
            if shape.num_frames is not None and (shape.num_frames - 1) % t:
                # A request's count is rounded as diffusers rounds it; a shape to warm is the shape
                # that runs, so it is refused: warming 9 frames for a config that says 8 would hide it.
                raise RequestLimitError(
                    f"num_frames={shape.num_frames} is not a count this model's VAE takes: {t}k+1 (e.g. "
                    f"{t * ((shape.num_frames - 1) // t) + 1} or {t * ((shape.num_frames - 1) // t + 1) + 1})"
                )
            body = VideoCreateRequest(**fields, num_frames=shape.num_frames, input_reference=image)
            request, fps = to_video_request(body, config, facts["temporal_compression"], request_id)
            return request, fps
        if (shape.num_frames or 1) != 1:
            raise RequestLimitError(f"the model makes images, which have 1 frame, not num_frames={shape.num_frames}")
        request = to_generation_request(ImageGenerationRequest(**fields, input_reference=image), config, request_id)
        return request, 0
    except RequestLimitError as err:
        raise ValueError(f"warm_up {shape.model_dump(exclude_defaults=True)}: {err}") from None


def served_shapes(config: AppConfig, facts: dict) -> list[WarmUpShape]:
    """The shapes a group warms (``AppConfig.warm_up_shapes``); by default (with compile), each
    route's default shape: ``default_size`` at the default clip length and, for a text-to-video
    model, at one frame too (its ``/v1/images/generations``), so that neither route's first request
    compiles."""
    shapes = config.warm_up_shapes()
    if config.warm_up is None and shapes and facts.get("video") and not facts.get("image_input"):
        shapes.append(WarmUpShape(size=config.default_size, num_frames=1))
    return shapes


def check_shapes(config: AppConfig) -> bool:
    """Builds each warm-up shape's request as ``warm_up`` will, from the facts of the pipeline's
    call read before any weight is (``start_checks.pipeline_on_meta``): a shape the model cannot
    take fails a replica's start here, in a second, with its reason, and ``ray-hsdp check`` with the
    same message.

    Returns:
        Whether the shapes are checked: False where this node does not hold the model's folder (a
        replica, which does, checks them again).

    Raises:
        ValueError: Naming the shape and why the model refuses it.
    """
    if not config.warm_up_shapes():
        return True
    # Here, not at the module's top: the app builder and the replicas import this module, and
    # import no torch until a check needs it.
    from ray_hsdp.loading.components import resolve_model_path
    from ray_hsdp.loading.start_checks import pipeline_on_meta
    from ray_hsdp.pipeline.sharded import call_facts

    try:
        folder = resolve_model_path(config.model)
    except FileNotFoundError:
        return False
    facts = call_facts(pipeline_on_meta(folder, config.pipeline_class))
    for index, shape in enumerate(served_shapes(config, facts)):
        warm_up_request(shape, config, facts, index)
    return True


def start_warm(group: Engine, config: AppConfig) -> Engine:
    """Starts ``group`` and warms the app's shapes (``AppConfig.warm_up_shapes``); without shapes,
    the group's own start (with compile, its small warm-up per lane). The model's weight files are
    read ahead into the page cache meanwhile (``page_cache``). How a replica builds its group, at
    its start and for a rebuild.

    Raises:
        ValueError: A shape is not one the model takes, or an adapter's defaults are not a schedule
            its pipeline runs (the group is shut down).
    """
    # On the ranks' node (a replica shares its group's placement group): the disk reads while they start.
    read_ahead_in_background(config.model)
    shapes = config.warm_up_shapes()
    group.start(warm_up=not shapes)  # the shapes' warm-up compiles what the small one would
    try:
        refuse_adapter_schedules(config, group.pipeline_facts)
    except ValueError:
        group.shutdown()
        raise
    if shapes:
        warm_up(group, config, served_shapes(config, group.pipeline_facts))
    return group


def refuse_adapter_schedules(config: AppConfig, facts: dict) -> None:
    """An adapter's defaults that every request naming it (every request, for a fused one) would
    be refused for: the deployment's error, said at its start, never a client's 400.

    Raises:
        ValueError: Naming the adapter, the default and what to set instead.
    """
    for name, defaults in config.lora_defaults.items():
        if defaults.sigmas and config.sample_solver is None and not facts.get("euler"):
            raise ValueError(
                f"lora_defaults {name!r}: sigmas with the pipeline's own scheduler, which is not diffusers' "
                "flow-match Euler: set sample_solver: euler"
            )
        if defaults.boundary_ratio is not None and not facts.get("guidance_scale_2"):
            raise ValueError(f"lora_defaults {name!r}: boundary_ratio on a one-expert model: leave it out")


def warm_up(group: Engine, config: AppConfig, shapes: list[WarmUpShape]) -> None:
    """Runs each shape on every lane of a started ``group`` (``ShardGroup.warm_up``) and encodes
    one result of each as its response would be.

    Raises:
        ValueError: A shape is not one the model takes; InvalidRequestError: not one its lanes
            take. Either way the group is shut down.
    """
    try:
        requests = []
        for i, shape in enumerate(shapes):  # a user's request at the shape, decoded only if the shape says so
            request, fps = warm_up_request(shape, config, group.pipeline_facts, i)
            requests.append((dataclasses.replace(request, decode=shape.decode), fps))
        for request, _ in requests:
            group.check(request)  # a size whose tokens do not split over a lane: refused before any runs
    except BaseException:
        group.shutdown()
        raise
    rates = {request.request_id: fps for request, fps in requests}

    def encode(request: GenerationRequest, result: GenerationResult) -> None:
        frames, fps = result.frames[0], rates[request.request_id]
        if fps:
            encode_mp4(frames, fps)
            encode_png(frames[0])  # the job's thumbnail
        else:
            image_response(result, config.served_model_name)

    group.warm_up([request for request, _ in requests], follow=encode)
    logger.info(
        "Warmed %s in %.1f s", [f"{r.width}x{r.height}x{r.num_frames}" for r, _ in requests],
        group.phases.seconds["warm-up"],
    )  # fmt: skip
