"""``ray-hsdp check FILE``: a Serve YAML checked without starting Ray. For each application of
ray_hsdp: its configuration (``AppConfig``, with the device of the YAML or of ``--device``), the
checks a rank's start makes before any weight loads (``ray_hsdp.loading.start_checks``: the same code, on
the folder's classes and its sharded diffusers models built on the meta device), its LoRA sources,
the resolved layout, and the weights each GPU will hold (a sharded diffusers model's computed from
its meta-device build with ``keep_gathered`` and ``quantization``; the others read from the folder's
safetensors headers, the sharded ones over the shard size), against ``--gpu-memory`` when given. An
embedded tiny model is written where a rank writes it. A model folder or LoRA source that is not on
this machine is reported; it fails the check only with ``--strict`` (paths are the cluster's)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from ray_hsdp.cli.check_shares import ShareMember, share_lines
from ray_hsdp.config.app import AppConfig
from ray_hsdp.config.embedded import EMBEDDED_MODELS
from ray_hsdp.config.endpoint import EndpointConfig, endpoint_args, model_args, served_models

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


@dataclass
class AppReport:
    """What ``check`` found for one application: its failures, and what it would run."""

    name: str
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    layout: str = ""
    per_gpu: dict[str, int] = field(default_factory=dict)  # component -> bytes on each GPU
    share: ShareMember | None = None  # its model's place in a GPU share (``check_shares``)


def model_weight_bytes(module, config, shard_size: int) -> int:
    """Bytes of a sharded diffusers model's weights on each GPU of a group of ``shard_size`` ranks
    of ``config``: built on the meta device in the served dtype (float32-kept modules included),
    its policy's units sharded, but the units ``keep_gathered`` keeps whole (the ranks' own pick,
    ``kept_units``; 1 keeps the root too), the replicated submodules and a unit's parameters of a
    minority dtype whole; with ``quantization: fp8`` the units' linears at one byte a weight plus
    one float32 scale per row, every row's scale on every rank."""
    from ray_hsdp.sharding.apply import minority_dtype_params
    from ray_hsdp.sharding.fp8 import fp8_candidates
    from ray_hsdp.sharding.in_place import kept_units
    from ray_hsdp.sharding.policy import resolve_plan

    plan = resolve_plan(module, config.min_num_params)
    ordered = plan.units_in_forward_order(module)
    kept = kept_units(len(ordered), config.keep_gathered)
    whole = {id(p) for _, m in plan.replicated for p in m.parameters()}
    unit_of: dict[int, int] = {}
    for i, (_, unit) in enumerate(ordered):
        whole |= {id(p) for p in minority_dtype_params(unit)}
        for param in unit.parameters():
            unit_of.setdefault(id(param), i)
    fp8 = {id(linear.weight): linear.out_features for *_, linear in fp8_candidates(plan)}
    fp8 = fp8 if config.quantization == "fp8" else {}
    total = 0
    for param in module.parameters():
        nbytes = param.numel() * (1 if id(param) in fp8 else param.element_size())
        unit = unit_of.get(id(param))
        kept_whole = unit in kept if unit is not None else config.keep_gathered >= 1
        total += nbytes if shard_size == 1 or id(param) in whole or kept_whole else -(-nbytes // shard_size)
        total += fp8.get(id(param), 0) * 4
    return total


def start_refusals(config: AppConfig, dims, folder: Path, report: AppReport):
    """What the ranks' start would refuse for the layout ``dims``, by its own checks
    (``ray_hsdp.loading.start_checks``) on the folder's classes and its sharded diffusers models built on
    the meta device, added to ``report``'s failures; the models, for the weights per GPU (``None``
    when a check failed)."""
    from ray_hsdp.loading.fp8_folder import stored_fp8_components
    from ray_hsdp.loading.start_checks import refuse_start, start_facts

    try:
        facts = start_facts(folder, config.pipeline_class, config.shard_components, config.dtype)
        refuse_start(
            facts, dims, config.attention_backend, config.cache.kind, config.sample_solver, config.scheduler_config
        )
        stored_fp8_components(
            folder, config.quantization, config.dtype, config.min_num_params, config.fuse_loras, None,
            config.shard_components, fused_files_here(config),
        )  # fmt: skip
    except ValueError as err:
        report.failures.append(str(err))
        return None
    return facts.models


def fused_files_here(config: AppConfig) -> dict:
    """The files of ``fuse_loras`` that this machine holds (adapter -> component -> path): what
    an FP8 folder's record is compared with (``lora_notes`` reports the others)."""
    from ray_hsdp.loading.components import resolve_lora_path

    files: dict = {}
    for name, parts in config.lora_sources(fused=True).items():
        for component, source in parts.items():
            try:
                files.setdefault(name, {})[component] = resolve_lora_path(source)
            except FileNotFoundError:
                pass
    return files


def lora_notes(config: AppConfig, folder: Path, models: dict | None, report: AppReport, strict: bool) -> None:
    """Each LoRA source resolved as a rank's start resolves it and read as it reads it
    (``lora_state.read_adapter``, against the model's transformer built on meta where the start's
    checks built it): what it applies, a note; one not on this machine or that a rank would refuse
    (a key it would not apply, a module the model lacks), a note, a failure with ``strict`` (paths
    are the cluster's, as the model folder's)."""
    from ray_hsdp.loading.adapters import check_targets
    from ray_hsdp.loading.components import pipeline_class, resolve_lora_path
    from ray_hsdp.loading.lora_state import read_adapter

    try:
        pipeline_cls = pipeline_class(folder, config.pipeline_class)
    except ValueError:
        return  # the start's checks report it
    for name, parts in config.lora_sources().items():
        for component, source in parts.items():
            where = f"lora {name!r} ({component})"
            try:
                adapter = read_adapter(pipeline_cls, resolve_lora_path(source), where)
                if models is not None and component in models:
                    check_targets(models[component], adapter)
            except (FileNotFoundError, ValueError) as err:
                message = str(err) if str(err).startswith(where) else f"{where}: {err}"
                (report.failures if strict else report.notes).append(message)
                continue
            report.notes.append(f"{where} applies {adapter.summary()}")


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
    if config.model in EMBEDDED_MODELS:  # written as a rank writes it on its first start
        from ray_hsdp.loading.components import resolve_model_path

        folder = resolve_model_path(config.model)
    else:
        folder = Path(config.model)
    if not (folder / "model_index.json").is_file():
        (report.failures if strict else report.notes).append(f"model folder {folder} is not on this machine")
        return report
    models = start_refusals(config, dims, folder, report)
    from ray_hsdp.serve.replica.warm_up import check_shapes

    try:
        check_shapes(config)  # the start's own check of the warm-up shapes, before any weight
    except ValueError as err:
        report.failures.append(str(err))
    lora_notes(config, folder, models, report, strict)
    if models is None:
        return report
    sharded = set(config.shard_components) if dims.shard_size > 1 else set()
    for component, size in component_bytes(folder, config.dtype).items():
        if component in models:
            report.per_gpu[component] = model_weight_bytes(models[component], config, dims.shard_size)
        else:
            report.per_gpu[component] = -(-size // dims.shard_size) if component in sharded else size
    total = sum(report.per_gpu.values())
    if config.gpu_share is not None:
        report.share = ShareMember(
            config.served_model_name, config.gpu_share, total, dims.shard_size, config.gpu_share_budget_gib,
            config.resident, config.sleep_level,
        )  # fmt: skip
    if gpu_memory_gib is not None and total > gpu_memory_gib * _GIB:
        report.failures.append(
            f"its weights take {total / _GIB:.2f} GiB on each GPU, over --gpu-memory {gpu_memory_gib:g} GiB: "
            "a larger shard_size, or fewer components replicated"
        )
    return report


def check_endpoint(app: dict, model_apps: set[str]) -> AppReport:
    """The report of an endpoint application (``build_endpoint``): its fields, its ingress'
    ``user_config`` over them, and a model application of this file for each model it names."""
    name = app.get("name", "default")
    report = AppReport(name)
    try:
        endpoint, models = endpoint_args(dict(app.get("args") or {}))
        for deployment in app.get("deployments") or []:
            if deployment.get("name") == "OpenAIIngress" and deployment.get("user_config"):
                EndpointConfig(**{**endpoint.model_dump(), **deployment["user_config"]})
    except (ValidationError, ValueError) as err:
        report.failures.append(str(err))
        return report
    missing = [model for model in models if model not in model_apps]
    if missing:
        report.failures.append(
            f"models names {', '.join(missing)}: no application of this file of that name builds a model "
            "(import_path ray_hsdp.serve:build_model, named by its model's id)"
        )
    report.layout = f"endpoint of {', '.join(models)}"
    return report


def check_model_app(app: dict, device, gpu_memory_gib, strict: bool) -> AppReport:
    """The report of a model application (``build_model``): its fields alone, and its name, which
    must be its model's id (the endpoint reaches it by that name)."""
    name, args = app.get("name", "default"), dict(app.get("args") or {})
    try:
        served = model_args(args).served_model_name
    except (ValidationError, ValueError) as err:
        return AppReport(name, failures=[str(err)])
    report = check_app(name, args, device, gpu_memory_gib, strict)
    if served != name:
        report.failures.append(
            f"application {name!r} serves model {served!r}: name a model application by its model's id "
            "(the endpoint reaches it, and requests name it, by that name)"
        )
    return report


def check_file(path: str, device: str | None = None, gpu_memory_gib: float | None = None, strict: bool = False):
    """The reports of every ray_hsdp application of the Serve YAML at ``path`` (others are skipped)."""
    import yaml

    loaded = yaml.safe_load(Path(path).read_text()) or {}
    apps = [app for app in loaded.get("applications") or [] if str(app.get("import_path", "")).startswith("ray_hsdp")]
    model_apps = {app.get("name") for app in apps if str(app["import_path"]).endswith(":build_model")}
    reports = []
    for app in apps:
        args = dict(app.get("args") or {})
        name = app.get("name", "default")
        if str(app["import_path"]).endswith(":build_endpoint"):
            reports.append(check_endpoint(app, model_apps))
        elif str(app["import_path"]).endswith(":build_model"):
            reports.append(check_model_app(app, device, gpu_memory_gib, strict))
        elif "models" not in args:
            reports.append(check_app(name, args, device, gpu_memory_gib, strict))
        else:  # an application of several models: the endpoint's fields once, then each model's report
            try:
                served = served_models(args)
            except ValueError as err:
                reports.append(AppReport(name, failures=[str(err)]))
                continue
            for model, block in zip(served.names, args["models"]):
                fields = {**block, **served.endpoint.model_dump()}
                reports.append(check_app(f"{name} / {model}", fields, device, gpu_memory_gib, strict))
    if not reports:
        reports.append(AppReport(path, failures=[f"{path} holds no application of ray_hsdp (import_path ray_hsdp...)"]))
    members = [report.share for report in reports if report.share is not None]
    if members:
        lines, failures = share_lines(members, gpu_memory_gib)
        reports.append(AppReport("GPU shares", failures=failures, notes=lines))
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
