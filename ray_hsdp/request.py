"""What a rank is asked to compute and what it hands back; shared by the group, ranks and Serve."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: Guidance when nobody says otherwise: Wan's and diffusers' usual 5.0 (the config and CLI defaults).
DEFAULT_GUIDANCE_SCALE = 5.0


class InvalidRequestError(ValueError):
    """A request refused for what it asks (HTTP 400): a field out of range, a pair of the table of
    refusals, an input the model does not take. Other errors, ``ValueError`` included, are ours
    (HTTP 500)."""


class RequestCancelledError(RuntimeError):
    """The request was cancelled (its video job deleted, or its client gone): it stopped at the end
    of a denoising step, before its decode. A missed deadline is a ``TimeoutError`` instead."""


class NonFiniteOutputError(RuntimeError):
    """The model's frames hold NaN or infinite values: a numeric fault of the model or its kernels
    (a quantization or attention backend that breaks on it), never of the request; answered as a
    server error rather than as frames that look like noise."""


class LaneCollectiveError(RuntimeError):
    """A request failed while its lane's ranks were in a collective of their own outside the ticks
    (a split decode): the other ranks of the lane may wait in it, so the rank's session fails."""


#: Step-cache kinds: diffusers' First Block Cache (decides from the first block's residual) and
#: TaylorSeer (a fixed schedule of full and predicted steps).
CACHE_KINDS = ("first_block", "taylorseer")


@dataclass(frozen=True)
class StepCache:
    """How one request reuses work across its denoising steps (an approximation it opted into).

    Attributes:
        kind: One of ``CACHE_KINDS``; the group must have loaded this kind's hooks.
        threshold: ``first_block``: a step runs the blocks after the first only when the first
            block's residual changed by more than this (relative mean absolute change) since the
            last step that ran them.
        interval: ``taylorseer``: after the warm-up, one full step in every ``interval``; the others
            are predicted from the last full steps.
        warmup_steps: ``taylorseer``: steps computed in full first (at least 1).
        full_after_step: ``taylorseer``: steps from this index on are computed in full; ``None``:
            none.
    """

    kind: str
    threshold: float = 0.05
    interval: int = 2
    warmup_steps: int = 1
    full_after_step: int | None = None


#: The schedulers a request may run its steps with (``GenerationRequest.sample_solver``).
SAMPLE_SOLVERS = ("unipc", "euler")


def check_sigmas(values) -> tuple[float, ...]:
    """A step schedule as a request or an adapter's defaults give it: one sigma per step, each in
    (0, 1], falling (before the scheduler's shift: 1.0, 0.75, 0.5, 0.25 is lightx2v's 4-step
    schedule of timesteps 1000, 750, 500, 250).

    Raises:
        ValueError: Not a non-empty list of numbers in (0, 1] that fall.
    """
    import math

    if not isinstance(values, (list, tuple)) or not values:
        raise ValueError(f"sigmas must be a non-empty list of numbers, got {values!r}")
    out = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"sigmas must be numbers, got {value!r}")
        if not 0 < value <= 1:
            raise ValueError(f"each sigma must be in (0, 1], got {value!r}")
        out.append(float(value))
    if any(b >= a for a, b in zip(out, out[1:])):
        raise ValueError(f"sigmas must fall from step to step, got {out}")
    return tuple(out)


@dataclass(frozen=True)
class GenerationRequest:
    """One generation job in diffusers terms.

    Attributes:
        prompt: Text prompt.
        negative_prompt: Negative prompt; ``None`` for the pipeline's default.
        width: Output width in pixels.
        height: Output height in pixels.
        num_frames: Frames of the output; 1 for an image.
        num_inference_steps: Denoising steps.
        guidance_scale: Classifier-free guidance scale; guidance is on when it is above 1.
        guidance_scale_2: Guidance of the low-noise expert of a two-expert pipeline (Wan2.2
            A14B); ``None``: the same as ``guidance_scale``.
        seed: Seed of the initial noise (a CPU ``torch.Generator``, so results match across devices).
        n: Outputs for this prompt, run as one batch.
        request_id: Caller's id, carried through for logs and results.
        timeout_s: Deadline from the moment a rank takes the request; ``None`` for the group's
            ``request_timeout_s``. A request past it is answered with an error and interrupted.
        uint8_frames: Return frames as uint8 (0-255) rather than float32 (0-1), converted on the
            rank: a quarter of the bytes to move (an 81-frame 720p video is 0.9 GB as float32).
        image: The first frame of an image-to-video request: a PNG of exactly ``width`` x
            ``height`` (``fit_image`` makes one from any image); ``None`` for text-to-video.
        lora: The LoRA adapters this request runs with, as ``(name, scale)`` pairs of the
            group's registered adapters (``parse_lora`` reads the forms clients send); empty: none.
        flow_shift: The shift of the scheduler's timesteps for this request (Wan's UniPC
            ``flow_shift``, a flow-match scheduler's ``shift``; distilled LoRAs ask for their own);
            ``None``: the pipeline's.
        cache: The request's step cache; ``None``: every step computed in full.
        boundary_ratio: Where a two-expert pipeline (Wan2.2 A14B) hands the steps from the
            high-noise expert to the low-noise one, as a fraction of the training timesteps;
            ``None``: the pipeline's own.
        sample_solver: The scheduler that runs the steps: ``"unipc"`` (diffusers' UniPC
            multistep, flow sigmas) or ``"euler"`` (diffusers' flow-match Euler), each at the
            request's or the pipeline's shift; ``None``: the pipeline's own scheduler.
        sigmas: The steps' sigmas before the shift, one per step (``check_sigmas``), for a
            flow-match Euler scheduler (a distilled model's schedule); ``None``: its own spacing.
        queue_deadline: When (``time.time()``) a rank must have taken the request, set once where
            it arrived (the server: arrival plus ``queue_timeout_s``) and kept through a rebuild's
            wait, the queue, a retry on another group and a takeover; ``None``: the group that
            queues it sets its own (``queue_timeout_s`` from then).
        lane_size: The ranks to run it on, in a group of adaptive lanes (``lane_sizes``); ``None``:
            the group chooses.
        deadline: When (``time.time()``) its answer is due, counted from its arrival: the group
            serves earliest targets first and an adaptive group's lane policy aims for it
            (``group.lanes``; nothing is stopped at it: ``timeout_s`` does that); ``None``: no target.
        decode: False: the pipeline returns its latents undecoded (``output_type="latent"``) in
            place of frames; a warm-up's that warms the steps only (``WarmUpShape.decode``).
        size_given: Whether the caller chose ``width`` and ``height`` (False: the server's
            ``default_size`` filled them in). A pipeline whose call takes no size (its output
            follows its input image) refuses a request that gave one, rather than drop it.
    """

    prompt: str
    negative_prompt: str | None = None
    width: int = 64
    height: int = 64
    num_frames: int = 1
    num_inference_steps: int = 2
    guidance_scale: float = DEFAULT_GUIDANCE_SCALE
    guidance_scale_2: float | None = None
    seed: int = 0
    n: int = 1
    request_id: str = ""
    timeout_s: float | None = None
    uint8_frames: bool = False
    image: bytes | None = field(default=None, repr=False)  # megabytes: never in a log line
    lora: tuple[tuple[str, float], ...] = ()
    flow_shift: float | None = None
    cache: StepCache | None = None
    boundary_ratio: float | None = None
    sample_solver: str | None = None
    sigmas: tuple[float, ...] | None = None
    queue_deadline: float | None = None
    lane_size: int | None = None
    deadline: float | None = None
    size_given: bool = True
    decode: bool = True

    def first_frame(self):
        """The image of an image-to-video request as the pipeline takes it (an RGB PIL image)."""
        import io

        from PIL import Image

        return Image.open(io.BytesIO(self.image)).convert("RGB")

    @property
    def forward_cost(self) -> int:
        """Work of one transformer forward, in output pixels: ranks in lock step wait for the largest."""
        return self.width * self.height * self.num_frames * self.n


def parse_size(size: str) -> tuple[int, int]:
    """Parses ``"WxH"`` into ``(width, height)``.

    Raises:
        ValueError: The text is not two positive integers joined by ``x``, or a side is not a multiple of 16.
    """
    parts = size.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"size must be 'WxH' with integer width and height, e.g. '64x64'; got {size!r}")
    width, height = int(parts[0]), int(parts[1])
    if width < 16 or height < 16 or width % 16 or height % 16:
        raise ValueError(f"width and height must be positive multiples of 16; got {width}x{height}")
    return width, height


def parse_lora(value) -> tuple[tuple[str, float], ...]:
    """The adapters a client asked for, as ``(name, scale)`` pairs in the order given.

    Forms: ``None`` or ``""`` (none); a name (scale 1.0); the string form ``"x:0.5,y"`` (what a
    form field or a command line carries); one ``{"name": ..., "scale": ...}`` object (vllm-omni's
    form); a list of names, of such objects, or of both.

    Raises:
        ValueError: A form not listed, an empty name, a scale that is not a finite number, or a
            name given twice.
    """
    import math

    if value is None:
        return ()
    if isinstance(value, str):
        items = [part.strip() for part in value.split(",") if part.strip()]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    elif isinstance(value, dict):
        items = [value]
    else:
        raise ValueError(f"lora must be a name, 'name:scale,...' or a list of {{'name', 'scale'}}; got {value!r}")
    pairs: list[tuple[str, float]] = []
    for item in items:
        if isinstance(item, str):
            name, _, scale = item.partition(":")
            scale = scale.strip() or 1.0
        elif isinstance(item, dict) and set(item) <= {"name", "scale"} and "name" in item:
            name, scale = item["name"], item.get("scale", 1.0)
        else:
            raise ValueError(f"lora entry {item!r}: expected a name, 'name:scale' or {{'name': ..., 'scale': ...}}")
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"lora entry {item!r} has no name")
        if isinstance(scale, bool):
            raise ValueError(f"lora {name!r}: the scale must be a number, got {scale!r}")
        try:
            number = float(scale)
        except (TypeError, ValueError):
            raise ValueError(f"lora {name!r}: the scale must be a number, got {scale!r}") from None
        if not math.isfinite(number):
            raise ValueError(f"lora {name!r}: the scale must be finite, got {scale!r}")
        pairs.append((name.strip(), number))
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"lora names an adapter twice: {names}")
    return tuple(pairs)


def fit_image(data: bytes, width: int, height: int) -> bytes:
    """The image in ``data`` fitted to ``width`` x ``height``, as a PNG: scaled (Lanczos) so that it
    covers the size, then cropped to it around its centre; alpha and palettes become RGB.

    Every layout and the tests' reference run take the image through this one rule, so that a
    sharded result and the unsharded pipeline's see the same pixels.

    Raises:
        InvalidRequestError: ``data`` is not an image PIL can decode.
    """
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as opened:
            image = opened.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError) as err:
        raise InvalidRequestError(f"the image could not be decoded ({err})") from None
    scale = max(width / image.width, height / image.height)
    covered = (max(width, round(image.width * scale)), max(height, round(image.height * scale)))
    if covered != image.size:
        image = image.resize(covered, Image.LANCZOS)
    left, top = (covered[0] - width) // 2, (covered[1] - height) // 2
    image = image.crop((left, top, left + width, top + height))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


@dataclass
class GenerationResult:
    """The output of one request.

    Attributes:
        frames: Shape ``(n, num_frames, height, width, 3)``: float32 in [0, 1], or uint8 when the
            request asked for ``uint8_frames``.
        seed: The seed that was used.
        rank: Index of the rank that computed it.
        elapsed_s: Seconds the rank spent in the pipeline.
        request_id: The request's id.
        peak_device_bytes: Peak device memory allocated on the rank since this request started (0 on
            CPU; requests running at once on one rank share the counter, so each sees the joint peak).
        step_s: Mean seconds between two denoising steps' ends; ``None`` for a one-step request.
        before_loop_s: Seconds from the rank's start of the request to its denoising loop's start
            (the first step's end less ``step_s``, at least 0): the text and image encodings, and
            the ticks the rank waited for meanwhile; ``None`` for a one-step request.
        after_loop_s: Seconds from the last step's end to the frames on the host: the decode;
            ``None`` when no step reported its end.
        cached_forwards: Of the request's transformer forwards on the rank that answered, those
            that reused its step cache instead of running every block; ``None``: no step cache.
        compiled: Whether ``torch.compile`` built graphs on the answering rank while it ran (a new
            shape or lane size): its times include the compile, and the group learns none of them.
    """

    frames: np.ndarray
    seed: int
    rank: int
    elapsed_s: float
    request_id: str = ""
    peak_device_bytes: int = 0
    step_s: float | None = None
    before_loop_s: float | None = None
    after_loop_s: float | None = None
    cached_forwards: int | None = None
    compiled: bool = False
