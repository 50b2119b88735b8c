"""``ray-hsdp check FILE``: a Serve YAML checked without starting Ray. For each application of
ray_hsdp: its configuration (``AppConfig``, with the device of the YAML or of ``--device``), the
table of refusals (its model rows against the folder's transformer and pipeline), the resolved
layout, and the weights each GPU will hold, read from the model folder's safetensors headers (the
sharded components over the shard size, the others whole, in the dtype served), against
``--gpu-memory`` when given. A model folder that is not on this machine is reported; it fails the
check only with ``--strict``."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from ray_hsdp.config import EMBEDDED_MODELS, AppConfig, embedded_folder

#: Bytes per element of the float dtypes a rank serves in.
_SERVED_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: Bytes per element of the dtypes a safetensors header names.
_STORED_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
                 "I8": 1, "U8": 1, "BOOL": 1}  # fmt: skip
_GIB = 1024**3


def safetensors_elements(path: Path) -> tuple[int, int]:
    """``(float elements, bytes of the others)`` of one safetensors file, from its header alone."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    floats = other = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        count = 1
        for dim in entry["shape"]:
            count *= dim
        if entry["dtype"].startswith(("F", "BF")):
            floats += count
        else:
            other += count * _STORED_BYTES.get(entry["dtype"], 1)
    return floats, other


def component_bytes(folder: Path, dtype: str) -> dict[str, int]:
    """Component -> its weights' bytes once loaded in ``dtype`` (floats cast, the rest as stored)."""
    index = json.loads((folder / "model_index.json").read_text())
    out = {}
    for name, spec in index.items():
        part = folder / name
        if name.startswith("_") or not isinstance(spec, list) or not part.is_dir():
            continue
        files = sorted(part.glob("*.safetensors"))
        if files:
            counts = [safetensors_elements(f) for f in files]
            out[name] = sum(floats for floats, _ in counts) * _SERVED_BYTES[dtype] + sum(o for _, o in counts)
    return out


def model_refusals(config: AppConfig, folder: Path) -> list[str]:
    """The model rows of the table of refusals (``ray_hsdp.pairs``) that the folder's transformer
    and pipeline hold with ``config``: what the ranks' load would refuse at start (the transformer
    built on the meta device, from its config alone)."""
    if not (folder / "transformer" / "config.json").is_file():
        return []
    from ray_hsdp.checkpoints.lora import transformer_on_meta
    from ray_hsdp.load_steps import refuse_step_cache
    from ray_hsdp.loading import pipeline_class
    from ray_hsdp.sharding import policies  # noqa: F401 (registers them)
    from ray_hsdp.sharding.context_parallel import refuse_split
    from ray_hsdp.sharding.policy import registered_policy

    transformer = transformer_on_meta(folder, tiny=False)
    failures = []
    try:
        if config.parallel_dims().splits_sequence:
            policy = registered_policy(type(transformer))
            refuse_split(transformer, policy.cp_plan if policy else None)
        if config.cache.kind != "none":
            refuse_step_cache(transformer, config.cache.kind, pipeline_class(folder, config.pipeline_class))
    except ValueError as err:
        failures.append(str(err))
    return failures


@dataclass
class AppReport:
    """What ``check`` found for one application: its failures, and what it would run."""

    name: str
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    layout: str = ""
    per_gpu: dict[str, int] = field(default_factory=dict)  # component -> bytes on each GPU


def check_app(name: str, args: dict, device: str | None, gpu_memory_gib: float | None, strict: bool) -> AppReport:
    """The report of one application's ``args``."""
    report = AppReport(name)
    if device is not None:
        args = {**args, "device": device}
    try:
        config = AppConfig(**args)
        config = config.resolve_device(config.device != "cpu")  # 'auto' checks as a GPU cluster
    except (ValidationError, ValueError) as err:
        report.failures.append(str(err))
        return report
    dims = config.parallel_dims()
    lanes = f"; lane sizes {list(dims.lane_sizes)}" if dims.adaptive else ""
    report.layout = (
        f"{dims.replicate_size} group(s) x {dims.shard_size} rank(s) on {config.device} ({config.dtype}); "
        f"{dims.num_lanes} lane(s) of {dims.lane_size}{lanes}"
    )
    embedded = config.model in EMBEDDED_MODELS
    folder = embedded_folder(config.model) if embedded else Path(config.model)
    if embedded and not (folder / "model_index.json").is_file():
        report.notes.append(f"{config.model!r}: the embedded tiny model, written on its first start")
        return report
    if not (folder / "model_index.json").is_file():
        (report.failures if strict else report.notes).append(f"model folder {folder} is not on this machine")
        return report
    report.failures += model_refusals(config, folder)
    sharded = set(config.shard_components) if dims.shard_size > 1 else set()
    for component, size in component_bytes(folder, config.dtype).items():
        report.per_gpu[component] = -(-size // dims.shard_size) if component in sharded else size
    total = sum(report.per_gpu.values())
    if gpu_memory_gib is not None and total > gpu_memory_gib * _GIB:
        report.failures.append(
            f"its weights take {total / _GIB:.2f} GiB on each GPU, over --gpu-memory {gpu_memory_gib:g} GiB: "
            "a larger shard_size, or fewer components replicated"
        )
    return report


def check_file(path: str, device: str | None = None, gpu_memory_gib: float | None = None, strict: bool = False):
    """The reports of every ray_hsdp application of the Serve YAML at ``path`` (others are skipped)."""
    import yaml

    loaded = yaml.safe_load(Path(path).read_text()) or {}
    reports = []
    for app in loaded.get("applications") or []:
        if not str(app.get("import_path", "")).startswith("ray_hsdp"):
            continue
        args = dict(app.get("args") or {})
        reports.append(check_app(app.get("name", "default"), args, device, gpu_memory_gib, strict))
    if not reports:
        reports.append(AppReport(path, failures=[f"{path} holds no application of ray_hsdp (import_path ray_hsdp...)"]))
    return reports


def render(reports: list[AppReport]) -> str:
    """The reports as the command prints them."""
    lines = []
    for report in reports:
        lines.append(f"{report.name}: {'FAILED' if report.failures else 'ok'}")
        lines += [f"  error: {failure}" for failure in report.failures]
        if report.layout:
            lines.append(f"  layout: {report.layout}")
        lines += [f"  note: {note}" for note in report.notes]
        for component, size in sorted(report.per_gpu.items()):
            lines.append(f"  weights per GPU: {component} {size / _GIB:.3f} GiB ({size} bytes)")
        if report.per_gpu:
            lines.append(f"  weights per GPU in all: {sum(report.per_gpu.values()) / _GIB:.3f} GiB")
    return "\n".join(lines)
