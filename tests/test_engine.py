"""The engine interface (``group.engine.Engine``) and ``ShardGroup``: the replica calls the members
the protocol names, and the group has each of them, methods with the same parameters."""

from __future__ import annotations

import inspect

from ray_hsdp.group import Engine, ShardGroup


def members(protocol) -> tuple[set[str], dict[str, inspect.Signature]]:
    """The protocol's attributes and its methods' signatures (its properties count as attributes)."""
    attributes = set(inspect.get_annotations(protocol))
    methods = {}
    for name, value in vars(protocol).items():
        if isinstance(value, property):
            attributes.add(name)
        elif inspect.isfunction(value) and not name.startswith("_"):
            methods[name] = inspect.signature(value)
    return attributes, methods


def test_shard_group_has_every_member_of_the_engine_interface():
    attributes, methods = members(Engine)
    assert {"submit", "cancel", "shutdown", "check_health"} <= set(methods) and "failure" in attributes
    for name, signature in methods.items():
        own = getattr(ShardGroup, name, None)
        assert callable(own), f"ShardGroup has no method {name}"
        assert list(inspect.signature(own).parameters) == list(signature.parameters), name
    # Attributes a group sets in its constructor, and its properties.
    set_there = inspect.getsource(ShardGroup.__init__)
    for name in attributes:
        assert isinstance(getattr(ShardGroup, name, None), property) or f"self.{name}" in set_there, name


def test_the_replica_names_the_interface_not_the_group():
    """The replica's modules build a ShardGroup in one place and otherwise type the Engine."""
    import ast

    from ray_hsdp.serve.replica import keeper, server, share_member, warm_up

    def named(module) -> int:
        tree = ast.parse(inspect.getsource(module))
        return sum(isinstance(node, ast.Name) and node.id == "ShardGroup" for node in ast.walk(tree))

    assert [named(m) for m in (keeper, share_member, warm_up)] == [0, 0, 0]
    assert named(server) == 1, "server.py names ShardGroup once: where it builds one"
