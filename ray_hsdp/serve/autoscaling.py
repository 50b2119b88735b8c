"""Serve's autoscaling of shard groups: the load each replica reports and the policy on it.

Serve counts a replica's ongoing requests, but a video job runs after its ``POST`` returned, so
Serve would see an idle replica whose group is busy for minutes. Each replica reports its group's
own load instead (``HSDPServer.record_autoscaling_stats``: requests queued and running, video jobs
included), and the policy sizes the pool on it. Serve applies ``min_replicas`` / ``max_replicas``
and the up- and downscale delays around the policy.
"""

from __future__ import annotations

import functools
import logging
import math

from ray_hsdp.config.blocks import AutoscalingSpec

#: The custom metric each replica reports: requests its group holds (queued or running).
LOAD_METRIC = "ray_hsdp_group_load"

#: Where Serve finds the policy (an import path: the controller imports it).
POLICY = "ray_hsdp.serve.autoscaling:group_load_policy"

#: The policy's answer, exported from Serve's controller (Prometheus: ``ray_`` + this).
TARGET_METRIC = "hsdp_autoscaling_target_groups"

logger = logging.getLogger("ray_hsdp")


@functools.cache
def _target_gauge():
    from ray.util.metrics import Gauge

    return Gauge(
        TARGET_METRIC,
        description="shard groups the autoscaling policy asks Serve for (before Serve's delays)",
        tag_keys=("application", "deployment"),
    )


def _report_target(ctx, groups: int) -> None:
    try:
        _target_gauge().set(groups, tags={"application": ctx.app_name, "deployment": ctx.deployment_name})
    except Exception as err:  # noqa: BLE001 - a metric must never stop the scaling
        logger.warning("Could not export the autoscaling target: %s", err)


def group_load_policy(ctx) -> tuple[int, dict]:
    """Groups for the load the replicas report: their total over the requests one group should
    hold (``target_ongoing_requests``: ``target_per_lane`` x lanes per group), rounded up.

    Args:
        ctx: Serve's ``AutoscalingContext``.

    Returns:
        The number of groups wanted (Serve bounds it and applies the delays) and the policy state.
    """
    loads = (ctx.aggregated_metrics or {}).get(LOAD_METRIC, {})
    if not loads:  # no report yet (replicas starting): keep what Serve targets now
        return ctx.target_num_replicas, ctx.policy_state
    wanted = math.ceil(sum(loads.values()) / ctx.config.target_ongoing_requests)
    low, high = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
    groups = max(low, min(high, wanted))
    _report_target(ctx, groups)
    return groups, ctx.policy_state


def autoscaling_config(spec: AutoscalingSpec, lanes_per_group: int) -> dict:
    """Serve's ``autoscaling_config`` of ``spec`` for groups of ``lanes_per_group`` lanes: our
    policy on the groups' own load, ``target_ongoing_requests`` being one group's share."""
    return {
        "min_replicas": spec.min_groups,
        "initial_replicas": spec.min_groups,
        "max_replicas": spec.max_groups,
        "target_ongoing_requests": spec.target_per_lane * lanes_per_group,
        "upscale_delay_s": spec.upscale_delay_s,
        "downscale_delay_s": spec.downscale_delay_s,
        "metrics_interval_s": spec.metrics_interval_s,
        "look_back_period_s": spec.look_back_period_s,
        "policy": {"policy_function": POLICY},
    }
