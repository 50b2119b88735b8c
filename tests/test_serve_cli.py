"""``ray-hsdp serve``'s options (``ray_hsdp.cli.serve_flags``): every configuration field reachable by a
flag and by ``--set``, a file of args or a Serve YAML to start from, vllm-omni's spellings, and the
refusals, each with its message; no Ray needed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from ray_hsdp.cli.serve_flags import UsageError, add_serve_options, default_app_name, field_flag, serve_config
from ray_hsdp.config.app import AppConfig

ROOT = Path(__file__).resolve().parents[1]


def parsed(*argv: str) -> argparse.Namespace:
    from ray_hsdp.cli.commands import build_parser

    return build_parser().parse_args(["serve", *argv])


def config_of(*argv: str) -> AppConfig:
    return serve_config(parsed(*argv))


def test_every_field_has_a_flag_and_is_reachable_by_set():
    parser = argparse.ArgumentParser()
    add_serve_options(parser)
    flags = {option for action in parser._actions for option in action.option_strings}
    defaults = AppConfig(model="tiny").model_dump(mode="json")
    for name in AppConfig.model_fields:
        if name == "model":
            continue
        assert field_flag(name) in flags, name
        # Each field set by --set to its default (as JSON) and by its flag: the same configuration.
        by_set = config_of("tiny", "--set", f"{name}={json.dumps(defaults[name])}")
        by_flag = config_of("tiny", field_flag(name), json.dumps(defaults[name]))
        assert getattr(by_set, name) == getattr(by_flag, name) == getattr(AppConfig(model="tiny"), name), name


def test_flags_set_values_nested_fields_and_json():
    config = config_of(
        "tiny", "--use-hsdp", "--device", "cpu", "--default-size", "64x64", "--default-steps", "4",
        "--vae-channels-last", "true",
        "--set", "autoscaling.max_groups=4", "--set", "loras={\"style\": \"/loras/style\"}",
        "--set", "model_name=wan",
    )  # fmt: skip
    assert (config.device, config.default_size, config.default_steps) == ("cpu", "64x64", 4)
    assert config.vae_channels_last
    assert config.autoscaling.max_groups == 4 and config.autoscaling.min_groups == 1  # the rest at its defaults
    assert config.loras == {"style": "/loras/style"} and config.model_name == "wan"
    assert config_of("tiny").shard_size == 1  # without --use-hsdp each GPU holds the whole model
    # --set is applied last: over the flags and the file.
    assert config_of("tiny", "--default-steps", "4", "--set", "default_steps=8").default_steps == 8


def test_vllm_omni_spellings():
    config = config_of(
        "tiny", "--use-hsdp", "--hsdp-shard-size", "4", "--hsdp-replicate-size", "2", "--ulysses-degree", "2",
        "--cfg-parallel-size", "2", "--cache-backend", "first_block",
    )  # fmt: skip
    assert (config.shard_size, config.replicate_size, config.ulysses_degree) == (4, 2, 2)
    assert config.cfg_parallel and config.cache.kind == "first_block"
    assert not config_of("tiny", "--cfg-parallel-size", "1").cfg_parallel
    assert config_of("tiny", "--use-hsdp", "--usp", "2").resolved_shard_size == 2  # the lane's size
    with pytest.raises(UsageError, match="--hsdp-shard-size shard the weights: add --use-hsdp"):
        config_of("tiny", "--hsdp-shard-size", "2")
    with pytest.raises(UsageError, match="--cfg-parallel-size 3: CFG parallel splits a step in 2"):
        config_of("tiny", "--use-hsdp", "--cfg-parallel-size", "3")
    with pytest.raises(UsageError, match="--cache-backend tea_cache: not served here; the step caches: none"):
        config_of("tiny", "--cache-backend", "tea_cache")
    with pytest.raises(UsageError, match="add --use-hsdp"):
        config_of("tiny", "--ulysses-degree", "2")


def test_refusals_name_the_field():
    with pytest.raises(UsageError, match="--set nope: no such configuration field"):
        config_of("tiny", "--set", "nope=1")
    with pytest.raises(UsageError, match="expected FIELD=VALUE"):
        config_of("tiny", "--set", "max_steps")
    with pytest.raises(ValidationError, match="max_steps"):
        config_of("tiny", "--set", "max_steps=0")
    with pytest.raises(ValidationError, match="lane_widening with cfg_parallel"):  # the table of refusals
        config_of("tiny", "--use-hsdp", "--set", "shard_size=4", "--set", "lane_sizes=[1,2,4]",
                  "--set", "cfg_parallel=true", "--set", "lane_widening=true")  # fmt: skip


def test_a_file_of_args_or_a_serve_yaml(tmp_path):
    shipped = ROOT / "serve_configs" / "tiny_cpu.yaml"
    apps = {app["name"]: app["args"] for app in yaml.safe_load(shipped.read_text())["applications"]}
    with pytest.raises(UsageError, match="pick one with --app"):
        config_of("tiny", "--config", str(shipped))
    config = config_of("tiny", "--config", str(shipped), "--app", "ray_hsdp", "--set", "max_steps=12")
    assert config.max_steps == 12 and config.device == apps["ray_hsdp"]["device"]
    assert config.shard_size == apps["ray_hsdp"]["shard_size"]  # the file's shard size, without --use-hsdp
    args_file = tmp_path / "args.yaml"
    args_file.write_text(yaml.safe_dump({"device": "cpu", "default_steps": 3}))
    assert config_of("tiny", "--config", str(args_file)).default_steps == 3
    two = tmp_path / "two.yaml"
    two.write_text(yaml.safe_dump({"applications": [{"name": "a", "args": {"default_steps": 5}},
                                                    {"name": "b", "args": {"default_steps": 7}}]}))  # fmt: skip
    with pytest.raises(UsageError, match="holds 2 applications \\(a, b\\): pick one with --app"):
        config_of("tiny", "--config", str(two))
    assert config_of("tiny", "--config", str(two), "--app", "b").default_steps == 7
    with pytest.raises(UsageError, match="--app c: .* holds a, b"):
        config_of("tiny", "--config", str(two), "--app", "c")


def test_the_application_is_named_after_the_model_folder():
    assert default_app_name("/models/Wan2.1-T2V-14B-Diffusers/") == "Wan2.1-T2V-14B-Diffusers"
    assert default_app_name("tiny") == "tiny"


def test_a_file_means_the_same_to_the_cli_as_to_serve_deploy(tmp_path):
    """Without --use-hsdp the CLI's vllm-omni rule (shard size 1) applies only where no file is
    given, and its refusal only to a split its own flags ask for."""
    cases = [
        ({"mode": "replicated", "replicate_size": 2, "device": "cpu"}, 2),
        ({"world_size": 4, "replicate_size": 2, "device": "cpu"}, 2),
        ({"ulysses_degree": 2, "device": "cpu"}, 2),
        ({"device": "cpu"}, 2),
    ]
    for fields, shard in cases:
        path = tmp_path / "app.yaml"
        path.write_text(yaml.safe_dump({"applications": [{"name": "a", "args": fields}]}))
        deployed = AppConfig(model="tiny", **fields)  # what serve deploy of the file builds
        by_cli = config_of("tiny", "--config", str(path))
        assert by_cli.resolved_shard_size == deployed.resolved_shard_size == shard, fields
        assert by_cli.parallel_dims() == deployed.parallel_dims(), fields
    with pytest.raises(UsageError, match="add --use-hsdp"):  # a split the flags ask for, still
        config_of("tiny", "--config", str(path), "--usp", "2")


def test_flags_merge_into_the_files_nested_blocks(tmp_path):
    path = tmp_path / "app.yaml"
    path.write_text(yaml.safe_dump({
        "device": "cpu", "shard_size": 2,
        "cache": {"kind": "taylorseer", "interval": 3, "warmup_steps": 2, "every_request": False},
        "loras": {"style": "/loras/style"}, "lora_defaults": {"style": {"num_inference_steps": 4}},
        "autoscaling": {"min_groups": 1, "max_groups": 3, "upscale_delay_s": 1},
    }))  # fmt: skip
    cache = config_of("tiny", "--config", str(path), "--cache-backend", "taylorseer").cache
    assert (cache.kind, cache.interval, cache.warmup_steps, cache.every_request) == ("taylorseer", 3, 2, False)
    assert config_of("tiny", "--config", str(path), "--cache", "first_block").cache.interval == 3
    config = config_of("tiny", "--config", str(path), "--lora-file", "extra=/p")
    assert config.loras == {"style": "/loras/style", "extra": "/p"} and "style" in config.lora_defaults
    # A two-expert model's adapter, a file per expert (the 4-step Wan2.2 YAML's quantize command).
    experts = config_of("tiny", "--shard-size", "2", "--lora-file", "fast.transformer=/high",
                        "--lora-file", "fast.transformer_2=/low")  # fmt: skip
    assert experts.loras == {"fast": {"transformer": "/high", "transformer_2": "/low"}}
    with pytest.raises(UsageError, match="'fast' is given both whole and per component"):
        config_of("tiny", "--shard-size", "2", "--lora-file", "fast=/a", "--lora-file", "fast.transformer_2=/low")
    scaling = config_of("tiny", "--config", str(path), "--autoscaling", '{"max_groups": 4}').autoscaling
    assert (scaling.min_groups, scaling.max_groups, scaling.upscale_delay_s) == (1, 4, 1)
    assert config_of("tiny", "--config", str(path), "--autoscaling", "null").autoscaling is None


def test_a_text_field_takes_the_text_as_typed():
    assert config_of("tiny", "--model-name", "2024").model_name == "2024"
    assert config_of("tiny", "--set", "model_name=true").model_name == "true"
    assert config_of("tiny", "--model-name", "null").model_name is None
    assert config_of("tiny", "--max-steps", "12").max_steps == 12  # numbers stay numbers


def test_app_takes_the_applications_name_and_route_prefix_too(tmp_path):
    from ray_hsdp.cli.serve_flags import file_application

    shipped = ROOT / "serve_configs" / "wan2.2_ti2v_5b.yaml"
    names = [app["name"] for app in yaml.safe_load(shipped.read_text())["applications"]]
    picked = [file_application(str(shipped), name) for name in names]
    assert [app["name"] for app in picked] == names and len({app["route_prefix"] for app in picked}) == len(names)
    args_file = tmp_path / "args.yaml"
    args_file.write_text(yaml.safe_dump({"device": "cpu"}))
    assert file_application(str(args_file), None) == {"args": {"device": "cpu"}}  # the CLI's defaults then


def test_a_yaml_of_several_models_takes_only_the_endpoints_fields_from_the_command_line():
    from ray_hsdp.cli.serve_flags import file_args, served_args
    from ray_hsdp.config.endpoint import served_models

    shipped = str(ROOT / "serve_configs" / "tiny_cpu_models.yaml")
    fields = served_args(parsed("--config", shipped, "--set", "retry_after_s=5"), file_args(shipped, None))
    served = served_models(fields)
    assert served.names == ["tiny-wan", "tiny-qwen-image"] and served.endpoint.retry_after_s == 5
    assert all(model.retry_after_s == 5 for model in served.models)  # each model carries the endpoint's value
    for argv, message in [
        (("tiny",), "serves several models .*: drop MODEL \\(tiny\\)"),
        (("--shard-size", "4"), "set shard_size in each model's block there"),
        (("--set", "default_steps=2"), "changes only the endpoint's fields"),
    ]:
        with pytest.raises(UsageError, match=message):
            served_args(parsed(*argv, "--config", shipped), file_args(shipped, None))
