"""Generic FSDP2 sharding of pipeline components and the per-model policies it reads."""

from ray_hsdp.sharding import policies  # noqa: F401 - registers the per-model policies
from ray_hsdp.sharding.apply import apply_fsdp, compile_units
from ray_hsdp.sharding.policy import ShardingPolicy, ShardingPolicyError, ShardPlan, register_policy, resolve_plan

__all__ = [
    "ShardPlan",
    "ShardingPolicy",
    "ShardingPolicyError",
    "apply_fsdp",
    "compile_units",
    "register_policy",
    "resolve_plan",
]
