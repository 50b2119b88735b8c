import pytest
import torch.nn as nn

from ray_hsdp.sharding import ShardingPolicy, ShardingPolicyError, register_policy, resolve_plan
from ray_hsdp.sharding.policy import name_matches


class Block(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.attn = nn.Linear(dim, dim)
        self.ff = nn.Linear(dim, dim)


class RepeatedBlocksModel(nn.Module):
    _repeated_blocks = ["Block"]

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.layers = nn.ModuleList(Block() for _ in range(3))


class NoSplitModel(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))


class ConditionsModel(nn.Module):
    _hsdp_shard_conditions = [lambda name, module: name.startswith("layers.") and name.count(".") == 1]
    # Conditions win over the class-name fallbacks.
    _repeated_blocks = ["Linear"]

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))


class PlainModel(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(dim, dim), nn.Linear(dim, dim))
        self.b = nn.Linear(dim, dim)


def names(plan):
    return [name for name, _ in plan.units]


def test_registered_policy_for_wan_transformer(tiny_model):
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel.from_pretrained(tiny_model, subfolder="transformer")
    plan = resolve_plan(model, min_num_params=10**9)
    assert sorted(names(plan)) == [f"blocks.{i}" for i in range(4)]
    assert plan.source == "policy for WanTransformer3DModel"


def test_registered_policy_for_umt5_encoder(tiny_model):
    from transformers import UMT5EncoderModel

    model = UMT5EncoderModel.from_pretrained(tiny_model, subfolder="text_encoder")
    plan = resolve_plan(model, min_num_params=10**9)
    assert sorted(names(plan)) == ["encoder.block.0", "encoder.block.1"]


def test_policy_registered_by_class_name_wins_and_keeps_modules_replicated():
    class PolicyModel(RepeatedBlocksModel):
        pass

    register_policy("PolicyModel", policy=ShardingPolicy(units=("layers.*",), keep_replicated=("embed",)))
    plan = resolve_plan(PolicyModel(), min_num_params=10**9)
    assert sorted(names(plan)) == ["layers.0", "layers.1", "layers.2"]
    assert [name for name, _ in plan.replicated] == ["embed"]


def test_policy_that_matches_nothing_is_an_error():
    class MismatchModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.x = nn.Linear(2, 2)

    register_policy("MismatchModel", policy=ShardingPolicy(units=("blocks.*",)))
    with pytest.raises(ShardingPolicyError, match="MismatchModel matches no submodule"):
        resolve_plan(MismatchModel(), min_num_params=1)


def test_shard_conditions_come_before_class_names():
    plan = resolve_plan(ConditionsModel(), min_num_params=10**9)
    assert sorted(names(plan)) == ["layers.0", "layers.1"]
    assert plan.source == "ConditionsModel._hsdp_shard_conditions"


def test_repeated_blocks_fallback():
    plan = resolve_plan(RepeatedBlocksModel(), min_num_params=10**9)
    assert sorted(names(plan)) == ["layers.0", "layers.1", "layers.2"]
    assert plan.source == "RepeatedBlocksModel._repeated_blocks"


def test_no_split_modules_fallback():
    plan = resolve_plan(NoSplitModel(), min_num_params=10**9)
    assert sorted(names(plan)) == ["layers.0", "layers.1"]
    assert plan.source == "NoSplitModel._no_split_modules"


def test_size_rule_fallback_wraps_bottom_up():
    # Each Linear(8, 8) has 72 parameters; "a" as a whole has 144.
    plan = resolve_plan(PlainModel(), min_num_params=100)
    assert names(plan) == ["a"]
    plan = resolve_plan(PlainModel(), min_num_params=72)
    assert names(plan) == ["a.0", "a.1", "b"]


def test_no_match_error_names_the_model_class():
    with pytest.raises(ShardingPolicyError, match="No sharding rule matches PlainModel"):
        resolve_plan(PlainModel(), min_num_params=10**6)


def test_units_are_ordered_deepest_first():
    class Nested(nn.Module):
        _hsdp_shard_conditions = [lambda name, module: isinstance(module, (Block, nn.ModuleList))]

        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(2))

    plan = resolve_plan(Nested(), min_num_params=10**9)
    assert names(plan)[-1] == "layers"
    assert set(names(plan)[:2]) == {"layers.0", "layers.1"}


@pytest.mark.parametrize(
    "name, pattern, expected",
    [
        ("blocks.3", "blocks.*", True),
        ("blocks.3.attn1", "blocks.*", False),
        ("blocks", "blocks.*", False),
        ("encoder.block.0", "encoder.block.*", True),
        ("single_blocks.1", "blocks.*", False),
    ],
)
def test_name_matches_one_segment_per_star(name, pattern, expected):
    assert name_matches(name, pattern) is expected
