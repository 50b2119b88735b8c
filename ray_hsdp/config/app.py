"""Typed, validated configuration of the Serve application around a shard group (``AppConfig``):
request defaults and limits, keys, the job store, warm-up shapes and autoscaling."""

from __future__ import annotations

from pydantic import Field, model_validator

from ray_hsdp.config.blocks import AutoscalingSpec, LoraDefaults, WarmUpShape
from ray_hsdp.config.group import GroupConfig
from ray_hsdp.request import DEFAULT_GUIDANCE_SCALE, parse_size


def check_lasting_store(job_store: str | None, media_store: str | None) -> None:
    """Refuses records that outlive the Ray cluster beside MP4s that do not (the default media
    folder is in the Ray session's folder: after ``ray stop`` every download would be gone)."""
    if job_store is not None and media_store is None:
        raise ValueError(
            "job_store is set (its records outlive the Ray cluster) but media_store is not (the MP4s would go in the "
            "Ray session's folder, gone at ray stop): set media_store to a folder every node mounts or an fsspec URL"
        )


class AppConfig(GroupConfig):
    """The Serve application: one shard group per replica plus request defaults and limits."""

    default_size: str = Field("832x480", description="Image size ('WxH') when a request gives none.")
    default_steps: int = Field(30, ge=1, description="Denoising steps when a request gives none.")
    default_guidance_scale: float = Field(
        DEFAULT_GUIDANCE_SCALE, ge=0, description="Guidance scale when a request gives none."
    )
    max_n: int = Field(4, ge=1, description="Largest number of images one request may ask for.")
    max_steps: int = Field(200, ge=1, description="Largest num_inference_steps a request may ask for.")
    max_pixels: int = Field(1280 * 1280, ge=256, description="Largest width x height a request may ask for.")
    max_prompt_chars: int = Field(4000, ge=1, description="Longest prompt or negative prompt, in characters.")
    max_body_bytes: int = Field(
        64 * 1024,
        ge=1024,
        description="Largest HTTP request body (HTTP 413 above it); an image or video request may add one "
        "input_reference of max_image_bytes (as base64, 4/3 of it).",
    )
    max_image_bytes: int = Field(
        10 * 1024**2, ge=1024, description="Largest input_reference image, in bytes once decoded (HTTP 413 above it)."
    )
    max_image_pixels: int = Field(
        4096 * 4096, ge=256, description="Largest width x height of an input_reference image (HTTP 400 above it)."
    )
    retry_after_s: int = Field(2, ge=1, description="Retry-After of an overload answer (HTTP 429).")
    fps: int = Field(16, ge=1, le=120, description="Frame rate of the served video model (Wan: 16); MP4s use it.")
    default_video_seconds: float = Field(
        4.0, gt=0, description="Clip length of a video job that gives neither seconds nor num_frames (OpenAI's 4)."
    )
    max_frames: int = Field(129, ge=1, description="Most frames a video job may ask for.")
    max_video_jobs: int = Field(
        256, ge=1, description="Most video jobs the job store keeps for this endpoint (HTTP 429 above)."
    )
    max_video_bytes: int = Field(
        2 * 1024**3,
        ge=1024,
        description="Most bytes of MP4s and thumbnails the job store keeps for this endpoint (HTTP 429 at it).",
    )
    video_ttl_s: float = Field(
        3600.0, gt=0, description="How long a finished video job is kept (its expires_at); then it is gone (404)."
    )
    sync_wait_s: float = Field(
        1800.0,
        gt=0,
        description="Longest a synchronous video call (/v1/videos/sync, the handle's generate_video) waits for its "
        "job; then it answers 504 naming the job, which goes on (GET /v1/videos/{id}). In the endpoint's args, the "
        "ingress' graceful shutdown outlasts it, so a restart of the ingress cuts no waiting caller; set in the "
        "ingress' user_config, it applies in place and the graceful shutdown stays as the args set it.",
    )
    job_store: str | None = Field(
        None,
        description="Where the video jobs' records live, as a SQLAlchemy URL (sqlite:////path/jobs.sqlite, "
        "postgresql+psycopg://user@host/db: its password in job_store_password_file or _env, never in the URL); "
        "they outlive every redeploy and restart. None: a SQLite file in the Ray session's folder on the head "
        "node (kept until the Ray cluster stops). One store per cluster: every endpoint of it names the same. "
        "Given, it needs media_store too (records that outlive the Ray cluster need MP4s that do).",
    )
    media_store: str | None = Field(
        None,
        description="Where the video jobs' MP4s and thumbnails live: a folder (on the head node, or one every "
        "node mounts) or an fsspec URL (s3://bucket/videos). None: a folder beside the default job_store's file.",
    )
    job_store_password_file: str | None = Field(
        None,
        description="A file holding the job_store database's password (its first line), read on the head node "
        "when the store opens its database (a Kubernetes Secret mounted in the head pod). The job_store URL "
        "then names no password: a URL with one is refused, since Serve keeps and shows an application's args.",
    )
    job_store_password_env: str | None = Field(
        None,
        description="An environment variable of the head node holding the job_store database's password, read "
        "when the store opens its database (instead of job_store_password_file).",
    )
    video_stale_after_s: float = Field(
        60.0,
        gt=0,
        description="A video job whose replica sent no report for this long while the job store could hear it (its "
        "database answered) is released: the ingress places it on another group of its model. A replica whose "
        "actor is dead releases its jobs at once; a store or database outage never counts.",
    )
    video_lost_wait_s: float = Field(
        300.0,
        gt=0,
        description="A released video job (its replica stopped reporting, its group failed under it, or its replica "
        "was removed) waits this long for another group of its model to run it again from the start (same seed); "
        "then it is failed.",
    )
    video_max_attempts: int = Field(
        3,
        ge=1,
        description="A video job whose group fails under it (or whose replica is lost) this many times fails, naming "
        "each attempt's error, instead of moving to another group again. A group that was full or removed "
        "(drain) costs no attempt.",
    )
    video_takeover_after_s: float | None = Field(
        2.0,
        gt=0,
        description="A video job is bound to the group that took its POST; one that has waited queued there this "
        "long is taken over by a group with a free lane (a group added for a burst serves the burst's backlog). "
        "None: no takeover (a job still moves when its group fails, is removed or is lost).",
    )
    metrics_interval_s: float = Field(
        5.0, gt=0, description="How often a replica reports its group's queue, ranks and the video jobs as metrics."
    )
    api_key_env: str = Field(
        "RAY_HSDP_API_KEY",
        description="Environment variable holding the API key; when it is set, every route but /health "
        "requires 'Authorization: Bearer <key>'.",
    )
    api_key_file: str | None = Field(
        None, description="File holding the API key (first line); takes precedence over api_key_env."
    )
    allow_unauthenticated: bool = Field(
        False,
        description="Serve without an API key on a HTTP host that is not a loopback address (anyone who reaches "
        "the port can generate). Off: a replica that finds no key refuses to start unless Serve's HTTP host is "
        "a loopback address.",
    )

    autoscaling: AutoscalingSpec | None = Field(
        None,
        description="Serve adds and removes shard groups with their load (min_groups to max_groups); None: a fixed "
        "pool of replicate_size groups.",
    )
    drain_timeout_s: float = Field(
        600.0,
        ge=0,
        description="A group Serve removes (downscale, redeploy) first finishes its video jobs for this long; then "
        "each is handed to another group (its seed makes the same video there); one that none takes fails with the "
        "reason.",
    )
    gpu_share: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="Name of a GPU share: the models of the cluster that name the same share take turns on the same "
        "shard_size GPUs of one node, one group each. A request for a sleeping model waits (its queue deadline "
        "counts) while the least recently used idle models sleep, their weights parked in pinned host memory, and "
        "its own wakes. Each model's ranks need host memory for their weights. None: the model's groups hold their "
        "GPUs alone.",
    )
    gpu_share_budget_gib: float | None = Field(
        None,
        gt=0,
        description="In a GPU share: the most GiB of weights per GPU that its awake models hold together (each "
        "model's as its ranks measured them at load); leave room beside it for every awake model's activations. "
        "Every model of a share gives the same. None: one model awake at a time.",
    )
    resident: bool = Field(
        False,
        description="In a GPU share: this model never sleeps (its weights count against gpu_share_budget_gib at "
        "all times).",
    )
    warm_up: list[WarmUpShape] | None = Field(
        None,
        description="Request shapes each group runs before it serves (at its start and after a rebuild), on every "
        "lane and with as few steps as reach every expert: a first request of a warmed shape compiles nothing. Each "
        "runs the transformer's steps (with a shape's decode: true, also the VAE decode and the response's PNG or "
        "MP4). Costs that run's time at each start. None: with compile, each route's default shape (default_size "
        "at the default clip length, and for a text-to-video model at one frame: its image route); without, none. "
        "[]: none (with compile, a small warm-up per lane compiles the first forwards).",
    )
    lora_defaults: dict[str, LoraDefaults] = Field(
        default_factory=dict,
        description="Per adapter of loras, the steps, guidance and flow_shift a request naming it gets when it "
        "gives none (for an adapter of fuse_loras: every request). A request's own values win; two named adapters "
        "that default a field differently need the request to give it.",
    )

    @model_validator(mode="after")
    def _check_share(self) -> AppConfig:
        if self.gpu_share is None:
            if self.resident or self.gpu_share_budget_gib is not None:
                raise ValueError("resident and gpu_share_budget_gib apply to a model of a GPU share: set gpu_share")
            return self
        if self.resident and self.gpu_share_budget_gib is None:
            raise ValueError(
                "resident: true needs gpu_share_budget_gib (without a budget one model of a GPU share is awake at a "
                "time, and a resident one would keep every other asleep)"
            )
        if self.replicate_size > 1 or self.autoscaling is not None:
            raise ValueError(
                "gpu_share holds one group of each of its models; it cannot be combined with replicate_size > 1 or "
                "autoscaling (give the model its own GPUs: no gpu_share)"
            )
        return self

    @model_validator(mode="after")
    def _check_against_limits(self) -> AppConfig:
        check_lasting_store(self.job_store, self.media_store)
        width, height = parse_size(self.default_size)
        if width * height > self.max_pixels:
            raise ValueError(f"default_size {self.default_size} exceeds max_pixels={self.max_pixels}")
        for shape in self.warm_up or []:
            shape_width, shape_height = parse_size(shape.size)
            if shape_width * shape_height > self.max_pixels:
                raise ValueError(f"warm_up size {shape.size} exceeds max_pixels={self.max_pixels}")
            if (shape.num_frames or 1) > self.max_frames:
                raise ValueError(f"warm_up num_frames={shape.num_frames} exceeds max_frames={self.max_frames}")
        unknown = sorted(set(self.lora_defaults) - set(self.loras))
        if unknown:
            raise ValueError(f"lora_defaults names {unknown}, which loras does not register")
        for name, defaults in self.lora_defaults.items():
            steps = len(defaults.sigmas) if defaults.sigmas else defaults.num_inference_steps or 0
            if steps > self.max_steps:
                raise ValueError(
                    f"lora_defaults {name!r}: num_inference_steps={steps}{' (its sigmas)' if defaults.sigmas else ''} "
                    f"exceeds max_steps={self.max_steps}"
                )
            if defaults.sigmas and self.sample_solver == "unipc":
                raise ValueError(
                    f"lora_defaults {name!r}: sigmas with sample_solver unipc: UniPC spaces its own steps and takes "
                    "no schedule; use sample_solver euler, or leave the sigmas out"
                )
        return self

    def warm_up_shapes(self) -> list[WarmUpShape]:
        """The shapes a group warms before it serves (``warm_up``, its default resolved)."""
        if self.warm_up is not None:
            return list(self.warm_up)
        return [WarmUpShape(size=self.default_size)] if self.compile else []

    def request_defaults(
        self, lora: tuple[tuple[str, float], ...], given: frozenset[str] = frozenset()
    ) -> dict[str, float | int]:
        """The steps and guidance a request gets for the fields it leaves out: the app's defaults,
        then the fused adapters' ``lora_defaults``, then those of the adapters it names.

        Args:
            lora: The adapters the request names.
            given: The fields the request gives itself (their defaults cannot conflict).

        Raises:
            ValueError: Two adapters default a field the request leaves out to different values
                (fused ones among themselves, or named ones among themselves).
        """
        out: dict[str, float | int] = {
            "num_inference_steps": self.default_steps,
            "guidance_scale": self.default_guidance_scale,
        }
        for names in (sorted(self.fuse_loras), [name for name, _ in lora]):
            layer: dict[str, tuple[str, float | int]] = {}
            for name in names:
                defaults = self.lora_defaults[name].model_dump(exclude_none=True) if name in self.lora_defaults else {}
                for field, value in defaults.items():
                    if field in layer and layer[field][1] != value and field not in given:
                        raise ValueError(
                            f"loras {layer[field][0]!r} and {name!r} default {field} to {layer[field][1]} and "
                            f"{value}: give {field} in the request"
                        )
                    layer[field] = (name, value)
            out.update({field: value for field, (_, value) in layer.items()})
        return out
