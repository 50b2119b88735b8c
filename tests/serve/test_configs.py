"""Every CPU YAML in ``serve_configs/`` starts with plain ``serve run`` on this machine and answers
equal to the unsharded run. Each is started once in the suite, by the fixture
named in ``STARTED_BY``: ``tiny_cpu.yaml`` is the package's shared server (``serve run`` joining the
session's cluster), ``tiny_cpu_usp.yaml`` is ``test_usp``'s, started as on a fresh 2-core machine
(no cluster, a Ray of its own with the real CPUs: the tighter fit, 4 ranks)."""

from __future__ import annotations

from pathlib import Path

import requests
import yaml

CONFIGS = Path(__file__).resolve().parents[2] / "serve_configs"


def devices(app: dict) -> list[str | None]:
    """The devices an application names: its one model's, or each of its models'; an endpoint
    application (``build_endpoint``) names none."""
    args = app["args"]
    if app["import_path"].endswith(":build_endpoint"):
        return []
    return [block.get("device") for block in args["models"]] if "models" in args else [args.get("device")]


def model_configs(app: dict) -> list:
    """The ``AppConfig`` of each model an application serves (none: an endpoint application)."""
    from ray_hsdp.config.endpoint import model_args, served_models

    if app["import_path"].endswith(":build_endpoint"):
        return []
    if app["import_path"].endswith(":build_model"):
        return [model_args(app["args"])]
    return served_models(app["args"]).models


CPU_YAMLS = sorted(
    path.name
    for path in CONFIGS.glob("*.yaml")
    if all(d == "cpu" for app in yaml.safe_load(path.read_text())["applications"] for d in devices(app))
)
STARTED_BY = {
    "tiny_cpu.yaml": "conftest.server",
    "tiny_cpu_usp.yaml": "test_usp.server",
    "tiny_cpu_models.yaml": "test_many_models.models_app",  # as serve deploy deploys it, beside the shared server
    "tiny_cpu_share.yaml": "replica.test_gpu_share.share_app",  # likewise, its models renamed, on a share of their own
}


def test_every_cpu_yaml_is_started_by_a_fixture_of_the_suite():
    assert set(CPU_YAMLS) == set(STARTED_BY), f"a CPU YAML nobody starts: {set(CPU_YAMLS) ^ set(STARTED_BY)}"


def test_every_gpu_yaml_is_a_valid_app_config():
    """The GPU YAMLs cannot start here: their app args at least validate, with the mesh they ask for."""
    gpu_yamls = sorted(set(p.name for p in CONFIGS.glob("*.yaml")) - set(CPU_YAMLS))
    assert gpu_yamls
    for name in gpu_yamls:
        for app in yaml.safe_load((CONFIGS / name).read_text())["applications"]:
            for config in model_configs(app):
                assert config.device == "cuda", name
                config.parallel_dims()  # the layout fits the shard size


def test_the_shared_server_is_the_tiny_yaml(server):
    """The server every serve module uses is this YAML's ``serve run``: text-to-video at ``/`` and
    image-to-video at ``/i2v``. Their answers equal the unsharded runs (``test_http``'s and
    ``test_videos_from_images``' parity tests; no request here, whose count would skew the metrics
    test)."""
    apps = yaml.safe_load((CONFIGS / "tiny_cpu.yaml").read_text())["applications"]
    for app in apps:
        pool = requests.get(f"{server}{app['route_prefix'].rstrip('/')}/v1/pool", timeout=60).json()
        assert (pool["shard_size"], pool["mode"]) == (app["args"]["shard_size"], app["args"]["mode"]), pool
        assert pool["model"] == {"tiny": "tiny-wan", "tiny-i2v": "tiny-wan-i2v"}[app["args"]["model"]]
