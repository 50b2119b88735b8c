"""Generic sharding (FSDP2 or in-place gathers) of pipeline components and the per-model policies it
reads.

Layer: Below loading: may import config and the shared modules (``request``, ``distributed``,
``phases``, ``memory``)."""

from ray_hsdp.sharding import policies  # noqa: F401 - registers the per-model policies
from ray_hsdp.sharding.apply import FsdpUnits, compile_repeated_blocks, compile_units, shard_module
from ray_hsdp.sharding.in_place import InPlaceUnits
from ray_hsdp.sharding.policy import ShardingPolicy, ShardingPolicyError, ShardPlan, register_policy, resolve_plan

__all__ = [
    "FsdpUnits",
    "InPlaceUnits",
    "ShardPlan",
    "ShardingPolicy",
    "ShardingPolicyError",
    "compile_repeated_blocks",
    "compile_units",
    "register_policy",
    "resolve_plan",
    "shard_module",
]
