"""What a group's start refuses before any rank loads a weight: one code, which every rank's
``prepare`` runs on its pipeline folder and ``ray-hsdp check`` runs on the same folder, so that a
file ``check`` passes starts, and one that would fail its start fails ``check`` with the start's
own message.

The checks read the folder's classes and configs, and the diffusers models among the components a
group shards, built from their configs on the meta device (no weights):

- the pipeline class the folder loads as (``pipeline_class``);
- the table's model rows (``ray_hsdp.config.pairs``): lanes that split a sequence the transformer has no
  plan for, a step cache the model or its pipeline cannot run, an attention backend whose kernels
  take no mask for a transformer that passes one;
- the lanes' split of each model's attention heads (Ulysses divides the heads);
- CFG parallel, which some sharded component's policy must declare (``cfg_split``).

LoRA sources are resolved where the start resolves them (``loading.resolve_lora_path``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch.nn as nn

from ray_hsdp.config.pairs import refuse_model
from ray_hsdp.config.schedulers import static_shift_key
from ray_hsdp.config.topology import ParallelDims
from ray_hsdp.loading.components import build_on_meta, model_index, pipeline_class
from ray_hsdp.sharding import step_cache
from ray_hsdp.sharding.context_parallel import refuse_heads, refuse_lane_heads, refuse_split
from ray_hsdp.sharding.pipeline_call import pipeline_call_for
from ray_hsdp.sharding.policy import registered_policy


@dataclass
class StartFacts:
    """What the checks built: the class the folder loads as, each sharded component's class and
    (for diffusers models) its module on the meta device, in the served dtype, and its
    scheduler's config as the folder gives it."""

    pipeline_cls: type
    classes: dict[str, type]
    models: dict[str, nn.Module]
    scheduler: dict | None = None


def start_facts(folder: Path, pipeline: str | None, shard_components: tuple[str, ...], dtype: str) -> StartFacts:
    """The facts of the pipeline folder at ``folder`` the checks read.

    Raises:
        ValueError: ``pipeline`` names no diffusers pipeline class (the start's message).
    """
    import importlib

    pipeline_cls = pipeline_class(folder, pipeline)
    index = model_index(folder)
    classes, models = {}, {}
    for name in (n for n in shard_components if n in index):
        library, class_name = index[name]
        classes[name] = getattr(importlib.import_module(library), class_name)
        if hasattr(classes[name], "enable_parallelism"):  # diffusers models: heads, plans, blocks
            models[name] = build_on_meta(folder / name, library, class_name, dtype)
    scheduler = folder / "scheduler" / "scheduler_config.json"
    return StartFacts(pipeline_cls, classes, models, json.loads(scheduler.read_text()) if scheduler.is_file() else None)


def pipeline_on_meta(folder: Path, pipeline: str | None):
    """The pipeline of ``folder`` with no weight read: its VAE built from its config on the meta
    device (the pipeline reads its compression from it), its scheduler loaded (a small config),
    its own settings from ``model_index.json`` (``boundary_ratio``), every other component None.
    What the pipeline's call takes (``sharded_pipeline.call_facts``) reads as from the loaded one.

    Raises:
        ValueError: ``pipeline`` names no diffusers pipeline class.
    """
    import importlib
    import inspect
    import json

    pipeline_cls = pipeline_class(folder, pipeline)
    index = model_index(folder)
    settings = {k: v for k, v in json.loads((folder / "model_index.json").read_text()).items() if k not in index}
    kwargs = {}
    for name, param in inspect.signature(pipeline_cls.__init__).parameters.items():
        if name == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if name in index:
            library, class_name = index[name]
            if name == "vae":
                kwargs[name] = build_on_meta(folder / name, library, class_name, "float32")  # no dtype read
            elif name == "scheduler":
                kwargs[name] = getattr(importlib.import_module(library), class_name).from_pretrained(folder / name)
            else:
                kwargs[name] = None
        elif name in settings and not name.startswith("_"):
            kwargs[name] = settings[name]
        elif param.default is param.empty:
            kwargs[name] = None
    return pipeline_cls(**kwargs)


def refuse_step_cache(module: nn.Module, kind: str, pipeline_cls: type) -> None:
    """Refuses a step cache of ``kind`` that ``module`` (a diffusers model) or its pipeline (of
    ``pipeline_cls``) cannot run (the model rows of ``ray_hsdp.config.pairs``).

    Raises:
        ValueError: Its message names the model, the cache, why, and what to do instead.
    """
    refuse_model(
        {
            "model": type(module).__name__,
            "cache": kind,
            "cache_blocks_known": step_cache.blocks_known(module),
            "cache_context": pipeline_call_for(pipeline_cls).cache_context,
        }
    )


def refuse_attention_backend(module: nn.Module, backend: str) -> None:
    """Refuses an attention backend whose kernels take no mask for a model whose policy says its
    attention always gets one (a model row of ``ray_hsdp.config.pairs``).

    Raises:
        ValueError: Its message names the model, the backend, why, and what to do instead.
    """
    policy = registered_policy(module)
    masks = bool(policy and policy.masks_attention)
    name = type(module).__name__.removeprefix("FSDP")
    refuse_model({"model": name, "attention_backend": backend, "masks_attention": masks})


def refuse_cfg_split(pipeline_name: str, dims: ParallelDims, classes: dict[str, type]) -> None:
    """Refuses CFG parallel where no sharded component's policy declares that the pipeline calls
    it for the conditional, then the unconditional prediction (``cfg_split``).

    Raises:
        ValueError: Naming ``cfg_parallel`` and the pipeline.
    """
    if dims.cfg != 2:
        return
    if not any(getattr(registered_policy(cls), "cfg_split", False) for cls in classes.values()):
        raise ValueError(
            f"cfg_parallel: no sharded component of {pipeline_name} declares in its sharding policy "
            "that the pipeline calls it for the conditional, then the unconditional prediction (cfg_split)"
        )


def refuse_start(
    facts: StartFacts,
    dims: ParallelDims,
    attention_backend: str,
    cache_kind: str,
    sample_solver: str | None = None,
    scheduler_config: dict | None = None,
) -> None:
    """Every check of the module doc on ``facts`` for a group of ``dims`` whose transformers run
    ``attention_backend`` (``auto``: the default) and a step cache of ``cache_kind`` (or
    ``none``), and whose requests run ``sample_solver`` by default on the folder's scheduler with
    ``scheduler_config``'s settings; first failure first.

    Raises:
        ValueError: The start's own message.
    """
    refuse_cfg_split(facts.pipeline_cls.__name__, dims, facts.classes)
    if facts.scheduler is not None:
        unknown = sorted(set(scheduler_config or {}) - set(facts.scheduler))
        if unknown:
            raise ValueError(
                f"scheduler_config sets {unknown}, which the folder's scheduler "
                f"({facts.scheduler.get('_class_name', 'its class')}) does not have: diffusers would ignore them"
            )
        shift = static_shift_key({**facts.scheduler, **(scheduler_config or {})})
        refuse_model({"model": facts.pipeline_cls.__name__, "sample_solver": sample_solver, "scheduler_shift": shift})
    for module in facts.models.values():
        if attention_backend != "auto":
            refuse_attention_backend(module, attention_backend)
        if cache_kind != "none":
            refuse_step_cache(module, cache_kind, facts.pipeline_cls)
        if dims.splits_sequence:
            policy = registered_policy(module)
            refuse_split(module, policy.cp_plan if policy else None)
            if dims.adaptive:
                refuse_lane_heads(module, {size: dims.lane_shape(size)[1] for size in dims.lane_sizes})
            else:
                refuse_heads(module, dims.ulysses)
