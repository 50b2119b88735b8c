"""``ray-hsdp serve``'s options, generated from the configuration models as ``vllm serve`` does:
every field of ``AppConfig`` is a flag (``--field-name VALUE``), ``--set FIELD=VALUE`` reaches any
field, nested ones by dotted names (``--set autoscaling.max_groups=4``), and ``--config FILE``
starts from a file: the ``args`` of one application, or a Serve YAML (``--app NAME`` picks one of
several). vllm-omni's spellings work too (``--use-hsdp``, ``--hsdp-shard-size``,
``--hsdp-replicate-size``, ``--cfg-parallel-size``, ``--cache-backend``; ``--ulysses-degree`` and
``--ring-degree`` are fields). Everything is validated by ``AppConfig``, with its messages.

Precedence, lowest first: the file, the vllm-omni spellings, the field flags, ``--set``. A flag
that gives a nested block (``--cache-backend``, ``--lora-file``, ``--cache KIND``, ``--autoscaling
'{...}'``) merges into the file's block, as ``--set block.field=...`` does. A file means what it
means to ``serve deploy``: vllm-omni's rule (without ``--use-hsdp`` each GPU holds the whole
model) applies only where no file is given, and its refusal only to a split its own flags ask for.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ray_hsdp.config.app import AppConfig
from ray_hsdp.config.endpoint import folded_applications

#: vllm-omni's ``--cache-backend`` values: ours by name, theirs refused with what we have instead.
CACHE_BACKENDS = {"none": "none", "first_block": "first_block", "taylorseer": "taylorseer"}

#: Fields the CLI takes as positionals or through an alias of its own, not as a field flag.
_NOT_FLAGS = {"model"}


class UsageError(ValueError):
    """A command line that cannot be served: the message says what to change (exit code 2)."""


def field_flag(name: str) -> str:
    """The flag of configuration field ``name``: ``default_size`` -> ``--default-size``."""
    return "--" + name.replace("_", "-")


def parse_value(text: str) -> Any:
    """A flag's or ``--set``'s value: JSON where it parses as JSON (numbers, booleans, lists,
    objects, ``null``), else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _takes_text(name: str) -> bool:
    """Whether field ``name`` of ``AppConfig`` holds text and nothing JSON would give (a number, a
    list, a mapping): its flag's value is then the text as typed (``--model-name 2024``)."""
    annotation = AppConfig.model_fields[name].annotation
    kinds = set(getattr(annotation, "__args__", ())) or {annotation}
    return str in kinds and kinds <= {str, type(None)}


def field_value(name: str, text: str) -> Any:
    """The value of field ``name`` (dotted names reach nested fields) given as ``text``: for a field
    of text the text itself (or the JSON string it quotes; ``null`` where the field may be unset),
    else ``parse_value``."""
    value = parse_value(text)
    if "." in name or name not in AppConfig.model_fields or not _takes_text(name):
        return value
    if value is None and type(None) in getattr(AppConfig.model_fields[name].annotation, "__args__", ()):
        return None
    return value if isinstance(value, str) else text


def merge_field(config: dict, name: str, value: Any) -> None:
    """Sets field ``name`` to ``value``; a mapping given for a block the config holds as a mapping
    (``cache``, ``loras``, ``autoscaling``, ...) merges into it, its keys replacing the block's."""
    present = config.get(name)
    if isinstance(present, BaseModel):
        present = present.model_dump()
    if isinstance(value, dict) and isinstance(present, dict):
        value = {**present, **value}
    config[name] = value


class _FieldValue(argparse.Action):
    """Stores a field flag's value in ``namespace.fields`` (only the flags given count)."""

    def __call__(self, parser, namespace, values, option_string=None):
        fields = dict(getattr(namespace, "fields", None) or {})
        fields[self.dest] = field_value(self.dest, values)
        namespace.fields = fields


def add_serve_options(parser: argparse.ArgumentParser) -> None:
    """Adds the file, ``--set``, vllm-omni's spellings and one flag per ``AppConfig`` field."""
    parser.set_defaults(fields={})
    parser.add_argument("--config", metavar="FILE", help="start from a file: an application's args, or a Serve YAML")
    parser.add_argument("--app", metavar="NAME", help="the application of --config's Serve YAML to take")
    parser.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", dest="overrides",
        help="set any configuration field (VALUE is JSON where it parses, else text; dotted names reach nested "
        "fields: autoscaling.max_groups=4); repeatable, applied last",
    )  # fmt: skip
    omni = parser.add_argument_group("vllm-omni's spellings")
    omni.add_argument("--use-hsdp", action="store_true", help="shard the weights over each group's GPUs")
    omni.add_argument("--hsdp-shard-size", type=int, help="ranks per shard group (with --use-hsdp)")
    omni.add_argument("--hsdp-replicate-size", type=int, help="number of shard groups (with --use-hsdp)")
    omni.add_argument("--cfg-parallel-size", type=int, help="2: CFG parallel on; 1: off")
    omni.add_argument("--cache-backend", help=f"a step cache: {', '.join(CACHE_BACKENDS)}")
    short = parser.add_argument_group("shorthands")
    short.add_argument("--usp", type=int, help="the same as --ulysses-degree")
    short.add_argument("--ring", type=int, help="the same as --ring-degree")
    short.add_argument(
        "--lora-file",
        action="append",
        default=[],
        metavar="NAME[.COMPONENT]=PATH",
        help="register a LoRA adapter (repeatable; .COMPONENT: one component's file, e.g. transformer_2)",
    )
    short.add_argument("--fuse-lora", metavar="NAME[:SCALE],...", help="registered adapters to merge into the weights")
    fields = parser.add_argument_group("configuration fields (docs/configuration.md)")
    for name, info in AppConfig.model_fields.items():
        if name in _NOT_FLAGS:
            continue
        fields.add_argument(
            field_flag(name), dest=name, action=_FieldValue, metavar="VALUE", default=argparse.SUPPRESS,
            help=(info.description or "") + " (JSON where it parses)",
        )  # fmt: skip


def file_application(path: str, app: str | None) -> dict:
    """The application in ``path``: ``{"args": ...}`` for a file of one application's args, or the
    one application of a Serve YAML (or the one ``app`` names), with its ``name`` and
    ``route_prefix`` where it gives them; a split layout (an endpoint application and one per
    model) folded into one application's args (``config_endpoint.folded_applications``).

    Raises:
        UsageError: The file holds several applications and none is picked, or no such one.
    """
    import yaml

    loaded = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(loaded, dict):
        raise UsageError(f"--config {path}: expected a mapping of fields or a Serve YAML, got {type(loaded).__name__}")
    if "applications" not in loaded:
        if app is not None:
            raise UsageError(f"--app {app}: {path} is one application's args, not a Serve YAML")
        return {"args": dict(loaded)}
    apps = loaded["applications"] or []
    names = [a.get("name", "default") for a in apps]
    try:
        folded = folded_applications(apps) if app is None else None
    except ValueError as err:
        raise UsageError(f"--config {path}: {err}") from None
    if folded is not None:  # the split layout, served here as one application
        return {"args": folded}
    if app is None and len(apps) != 1:
        raise UsageError(f"--config {path} holds {len(apps)} applications ({', '.join(names)}): pick one with --app")
    chosen = apps[0] if app is None else next((a for a in apps if a.get("name", "default") == app), None)
    if chosen is None:
        raise UsageError(f"--app {app}: {path} holds {', '.join(names)}")
    named = {key: chosen[key] for key in ("name", "route_prefix") if key in chosen}
    return {"args": dict(chosen.get("args") or {}), **named}


def file_args(path: str, app: str | None) -> dict:
    """The configuration in ``path`` (``file_application``'s ``args``)."""
    return file_application(path, app)["args"]


def set_dotted(config: dict, dotted: str, value: Any) -> None:
    """Sets ``config[a][b] = value`` for ``dotted`` ``a.b`` (a nested mapping is created or copied)."""
    *parents, last = dotted.split(".")
    node = config
    for part in parents:
        child = node.get(part)
        if isinstance(child, BaseModel):
            child = child.model_dump()
        node[part] = dict(child) if isinstance(child, dict) else {}
        node = node[part]
    node[last] = value


def lora_files(values: list[str]) -> dict[str, str | dict[str, str]]:
    """``--lora-file NAME=PATH`` (repeatable) as a ``loras`` config; ``NAME.COMPONENT=PATH`` gives one
    component its own file (a two-expert model's ``transformer`` and ``transformer_2``), as the YAML's
    ``loras: {NAME: {COMPONENT: PATH}}`` does."""
    loras: dict[str, str | dict[str, str]] = {}
    for value in values:
        key, sep, path = value.partition("=")
        name, _, component = key.partition(".")
        if not sep or not name or not path or (component == "" and key.endswith(".")):
            raise UsageError(f"--lora-file {value!r}: expected NAME=PATH or NAME.COMPONENT=PATH")
        had = loras.get(name)
        if had is not None and isinstance(had, dict) != bool(component):
            raise UsageError(f"--lora-file {value!r}: {name!r} is given both whole and per component")
        if component:
            loras.setdefault(name, {})[component] = path
        else:
            loras[name] = path
    return loras


def omni_fields(args: argparse.Namespace) -> dict:
    """The configuration vllm-omni's spellings and the shorthands ask for.

    Raises:
        UsageError: An ``--hsdp-*`` flag without ``--use-hsdp``, or a value we do not serve.
    """
    out: dict = {}
    hsdp = {"--hsdp-shard-size": args.hsdp_shard_size, "--hsdp-replicate-size": args.hsdp_replicate_size}
    given = [flag for flag, value in hsdp.items() if value is not None]
    if given and not args.use_hsdp:
        raise UsageError(
            f"{' and '.join(given)} shard the weights: add --use-hsdp (without it each GPU holds the whole model)"
        )
    if args.use_hsdp:
        if args.hsdp_shard_size is not None:
            out["shard_size"] = args.hsdp_shard_size
        if args.hsdp_replicate_size is not None:
            out["replicate_size"] = args.hsdp_replicate_size
    if args.cfg_parallel_size is not None:
        if args.cfg_parallel_size not in (1, 2):
            raise UsageError(
                f"--cfg-parallel-size {args.cfg_parallel_size}: CFG parallel splits a step in 2 (2: on, 1: off)"
            )
        out["cfg_parallel"] = args.cfg_parallel_size == 2
    if args.usp is not None:
        out["ulysses_degree"] = args.usp
    if args.ring is not None:
        out["ring_degree"] = args.ring
    if args.lora_file:
        out["loras"] = lora_files(args.lora_file)
    if args.fuse_lora:
        from ray_hsdp.request import parse_lora

        out["fuse_loras"] = dict(parse_lora(args.fuse_lora))
    if args.cache_backend is not None:
        kind = CACHE_BACKENDS.get(args.cache_backend)
        if kind is None:
            raise UsageError(
                f"--cache-backend {args.cache_backend}: not served here; the step caches: {', '.join(CACHE_BACKENDS)}"
            )
        out["cache"] = {"kind": kind}
    return out


def _splits(config: dict) -> bool:
    """Whether ``config`` (fields as given) splits requests over several ranks."""
    return any(config.get(f, 1) not in (1, False, None) for f in ("ulysses_degree", "ring_degree")) or bool(
        config.get("cfg_parallel")
    )


def serve_config(args: argparse.Namespace, file_fields: dict | None = None) -> AppConfig:
    """The application's configuration from the command line (the module doc's precedence).

    Args:
        file_fields: ``--config``'s fields, where the caller read them already.

    Raises:
        UsageError: The command line asks for something that cannot be served.
        pydantic.ValidationError: ``AppConfig`` refuses it (its message names the field).
    """
    if file_fields is None:
        file_fields = file_args(args.config, args.app) if args.config else {}
    config = dict(file_fields)
    config["model"] = args.model
    flags: dict = {}  # what the command line itself asks for, beside the file
    for name, value in (*omni_fields(args).items(), *args.fields.items()):
        if name == "cache" and isinstance(value, str):  # ``--cache KIND``: the kind alone
            value = {"kind": value}
        merge_field(flags, name, value)
        merge_field(config, name, value)
    for override in args.overrides:
        dotted, sep, text = override.partition("=")
        if not sep or not dotted:
            raise UsageError(f"--set {override!r}: expected FIELD=VALUE")
        if dotted.split(".")[0] not in AppConfig.model_fields:
            raise UsageError(f"--set {dotted}: no such configuration field (docs/configuration.md lists them)")
        set_dotted(flags, dotted, field_value(dotted, text))
        set_dotted(config, dotted, field_value(dotted, text))
    sized = any(config.get(f) for f in ("shard_size", "world_size", "lane_sizes"))
    if not args.use_hsdp and not sized:
        if _splits(flags):
            raise UsageError(
                "--ulysses-degree, --ring-degree and CFG parallel split requests over the ranks of a shard group, "
                "whose weights are sharded over them: add --use-hsdp (the shard size then defaults to the lane size)"
            )
        if not args.config:  # a file means what it means to serve deploy
            config["shard_size"] = 1  # vllm's way: without --use-hsdp each GPU holds the whole model
    return AppConfig(**config)


def served_args(args: argparse.Namespace, file_fields: dict) -> dict:
    """The application's ``args`` where ``--config``'s application names several ``models``: the
    file's, with ``--set`` changing the endpoint's fields (``config_endpoint``); each model's fields
    are the file's to give, so MODEL and the model flags are refused.

    Raises:
        UsageError: MODEL, a model flag, or ``--set`` of a model's field is given.
    """
    from ray_hsdp.config.endpoint import ENDPOINT_FIELDS

    if args.model:
        raise UsageError(f"--config {args.config} serves several models (its models list): drop MODEL ({args.model})")
    flags = sorted({*omni_fields(args), *args.fields})
    if flags:
        raise UsageError(
            f"--config {args.config} serves several models: set {', '.join(flags)} in each model's block there"
        )
    fields = dict(file_fields)
    for override in args.overrides:
        dotted, sep, text = override.partition("=")
        if not sep or dotted not in ENDPOINT_FIELDS:
            raise UsageError(
                f"--set {override!r}: with several models --set changes only the endpoint's fields "
                f"({', '.join(ENDPOINT_FIELDS)}); a model's are set in its block of --config"
            )
        fields[dotted] = field_value(dotted, text)
    return fields


def default_app_name(model: str) -> str:
    """The application name the CLI deploys under: the model folder's name (``tiny`` for the tiny model)."""
    name = Path(model.rstrip("/")).name or "model"
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)
