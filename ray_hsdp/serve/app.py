"""The app builders a Serve YAML points at.

An endpoint is one ingress (``OpenAIIngress``: HTTP and the handle API, a replica on each node) in
front of one group deployment per model (``HSDPServer``: a replica per shard group). Their video
jobs live in the cluster's job store (``jobs.actor``), which no application owns. Two layouts:

- ``ray_hsdp.serve:build_app``: the endpoint and its models in one application. Serve versions an
  application as a whole (a hash of its ``args``): an edit of any field restarts every group.
- ``ray_hsdp.serve:build_endpoint`` and one ``ray_hsdp.serve:build_model`` application per model
  (named by the model's id): an edit of one model's ``args`` restarts that model's groups alone;
  the endpoint's fields in its ingress' ``user_config`` apply in place, restarting nothing.
"""

from __future__ import annotations

import re

import ray
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from ray_hsdp.config.app import AppConfig
from ray_hsdp.config.endpoint import endpoint_args, model_args, served_models
from ray_hsdp.config.topology import PLACEMENT_STRATEGY
from ray_hsdp.group import check_placeable
from ray_hsdp.serve.autoscaling import autoscaling_config
from ray_hsdp.serve.credentials import refuse_inline_secrets
from ray_hsdp.serve.ingress.keys import KeyCheck
from ray_hsdp.serve.ingress.server import OpenAIIngress
from ray_hsdp.serve.jobs.actor import open_store
from ray_hsdp.serve.replica.server import HSDPServer
from ray_hsdp.serve.replica.warm_up import check_shapes
from ray_hsdp.serve.routing import SERVER_NAME, GroupAwareRouter

OVERFLOW = 64

#: Calls one ingress replica holds at once: every model's groups' room, and then some (it only forwards).
INGRESS_MAX_ONGOING = 4096


def build_endpoint(args: dict) -> Application:
    """Builds an endpoint application: its ingress alone, serving the model applications that
    ``models`` names (each built by ``build_model``, named by its model's id), by handle. The
    endpoint's fields come from ``args`` and, overriding them, from the ingress' ``user_config``
    (a Serve YAML's ``deployments: [{name: OpenAIIngress, user_config: {...}}]``), where an edit
    applies in place."""
    if not ray.is_initialized():
        ray.init()
    refuse_inline_secrets(args)  # before pydantic reads them: its errors quote the input
    endpoint, models = endpoint_args(args)
    start_store(endpoint)
    return ingress(endpoint, {model: model for model in models}, None)


def build_model(args: dict) -> Application:
    """Builds a model application: its group deployment alone (a replica per shard group), which
    an endpoint application's ingress reaches by the application's name (the model's id)."""
    if not ray.is_initialized():
        ray.init()
    config = model_args(args)
    return group_deployment(config.resolve_device(ray.cluster_resources().get("GPU", 0) > 0), 1)


def build_app(args: dict) -> Application:
    """Builds the ray_hsdp application (Serve's application builder: it takes the ``args`` of a
    Serve YAML application alone; each replica reads its API key where it runs)."""
    return build_application(args)


def server_name(model_id: str, models: int) -> str:
    """The group deployment's name of a model: ``HSDPServer``, or ``HSDPServer-<id>`` among several."""
    return SERVER_NAME if models == 1 else f"{SERVER_NAME}-{re.sub(r'[^A-Za-z0-9_.-]', '_', model_id)}"


def build_application(args: dict, api_key: str | None = None) -> Application:
    """Builds the ray_hsdp application: its ingress, and per model ``replicate_size`` replicas (or
    ``autoscaling``'s), each one shard group.

    Args:
        args: One model's ``AppConfig`` fields, or the endpoint's fields and ``models`` (a list of
            models' fields; ``config_endpoint``): the ``args`` of a Serve YAML application.
        api_key: The key the ingress asks for, carried from where the application is built
            (``ray-hsdp serve``'s environment) as its check (``serve.ingress.keys.KeyCheck``: the
            deployment holds no key); ``None``: each ingress replica finds its own (``serve.ingress.keys``).

    Returns:
        The bound ingress, ready for ``serve.run`` or a Serve config.
    """
    if not ray.is_initialized():
        ray.init()
    refuse_inline_secrets(args)  # before pydantic reads them: its errors quote the input
    served = served_models(args)
    has_gpus = ray.cluster_resources().get("GPU", 0) > 0
    # Started here, before any replica: a store with other locations fails the deploy, not a replica.
    start_store(served.endpoint)
    servers = {
        config.served_model_name: group_deployment(config.resolve_device(has_gpus), len(served.models))
        for config in served.models
    }
    return ingress(served.endpoint, servers, KeyCheck.of(api_key) if api_key else None)


def start_store(endpoint) -> None:
    """Opens the cluster's job store (its locations already free of secrets, ``refuse_inline_secrets``),
    which reads its database's password on its own node.

    Raises:
        ValueError: A store runs with other locations (``open_store``: its message shows no secret).
    """
    open_store(
        endpoint.job_store,
        endpoint.media_store,
        password_file=endpoint.job_store_password_file,
        password_env=endpoint.job_store_password_env,
    )


def ingress(endpoint, servers: dict, key: KeyCheck | None) -> Application:
    """The endpoint's ingress, bound to its models' group deployments (or their applications' names)."""
    nodes = sum(1 for node in ray.nodes() if node["Alive"])
    return OpenAIIngress.options(
        # One on each node: Serve starts an HTTP proxy only where a replica lives (EveryNode), and a
        # proxy prefers its own node's replica, so a node's loss takes only its own ingress.
        num_replicas=nodes,
        max_replicas_per_node=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=INGRESS_MAX_ONGOING,
        # A replica Serve stops (its code changed) first answers every synchronous video it waits for.
        graceful_shutdown_timeout_s=endpoint.sync_wait_s + 10,
        user_config={},
    ).bind(endpoint.model_dump(), servers, key)


def group_deployment(config: AppConfig, models: int) -> Application:
    """One model's group deployment, bound: its replicas are its shard groups."""
    dims = config.parallel_dims()
    bundles = dims.bundles(config.device, config.cpus_per_rank)
    check_placeable(bundles)  # else Serve waits forever for a node that could hold the replica
    # A warm-up shape the model refuses fails the deploy here, not at each replica.
    shapes_checked = check_shapes(config)
    # A fixed pool of replicate_size groups, or as many as the load calls for.
    if config.autoscaling is not None:
        scale = {"autoscaling_config": autoscaling_config(config.autoscaling, dims.widest_lanes)}
    else:
        scale = {"num_replicas": dims.replicate_size}
    # A replica's placement group holds its group's GPUs; a model of a GPU share places its ranks in
    # the share's (serve.replica.gpu_share), so that its replica holds none of the GPUs the models take turns on.
    placement = (
        {} if config.gpu_share else {"placement_group_bundles": bundles, "placement_group_strategy": PLACEMENT_STRATEGY}
    )
    return HSDPServer.options(
        name=server_name(config.served_model_name, models),
        **scale,
        # A removed group drains its video jobs first (HSDPServer.__del__), then shuts its ranks down.
        graceful_shutdown_timeout_s=config.drain_timeout_s + 60,
        **placement,
        # The replica process only routes; its bundle's resources belong to rank 0.
        ray_actor_options={"num_cpus": 0},
        # Room for every rank's requests, the group's own queue and a margin of requests that the
        # group answers at once with 429; Serve's router queues at most OVERFLOW more (its 503).
        max_ongoing_requests=dims.num_lanes * config.requests_per_rank + config.max_queue + OVERFLOW,
        max_queued_requests=OVERFLOW,
        # Healthy groups first, and a retry never back to the group that failed it; the stats
        # say within a second when a group broke.
        request_router_config=RequestRouterConfig(
            request_router_class=GroupAwareRouter, request_routing_stats_period_s=1
        ),
    ).bind(config.model_dump(), dims, shapes_checked)
