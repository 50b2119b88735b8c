"""Generic sharding of a model as its plan says: FSDP2 (units bottom-up, then the root) or in-place gathers."""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from ray_hsdp.sharding.in_place import InPlaceUnits, kept_units
from ray_hsdp.sharding.policy import ShardPlan, minority_dtype

logger = logging.getLogger("ray_hsdp")


def _managed_params(unit: nn.Module) -> list[torch.Tensor]:
    """Parameters ``fully_shard(unit)`` would own: those not inside an already sharded submodule."""
    nested = {id(p) for n, m in unit.named_modules() if n and isinstance(m, FSDPModule) for p in m.parameters()}
    return [p for p in unit.parameters() if id(p) not in nested]


def minority_dtype_params(unit: nn.Module) -> set[torch.Tensor]:
    """The unit's own parameters (``fully_shard`` would own them) that stay out of its flat buffer
    (``minority_dtype``)."""
    return minority_dtype(_managed_params(unit))


class FsdpUnits:
    """A root module sharded by FSDP2: ``fully_shard`` on every unit of the plan, then on the root.

    The same interface as ``InPlaceUnits``: ``unit_modules``, ``buffer_bytes``, ``activate``
    and ``ghost``.

    Args:
        root: The module to shard (on the meta device); becomes the root FSDP unit.
        plan: Units (deepest first) and the submodules that stay replicated. Parameters of a
            minority dtype in a unit stay replicated too (see ``minority_dtype_params``).
        mesh: The group's ``shard`` mesh.
        reshard_after_forward: The group's setting; the plan's own value wins when set.
        forward_prefetch: How many following units each unit's forward starts gathering
            (explicit FSDP2 forward prefetch); 0 leaves FSDP2's default.
        keep_gathered: Share of the units (``kept_units`` picks them) gathered once by
            ``activate`` and never resharded; 1 keeps the root too.
    """

    buffer_bytes = 0  # FSDP2 allocates its gathered weights per forward
    kept_bytes = 0  # kept units hold their unsharded weights as FSDP2's own parameters

    def __init__(
        self,
        root: nn.Module,
        plan: ShardPlan,
        mesh: DeviceMesh,
        reshard_after_forward: bool,
        forward_prefetch: int = 0,
        keep_gathered: float = 0.0,
    ):
        reshard = plan.reshard_after_forward if plan.reshard_after_forward is not None else reshard_after_forward
        self.reshard_after_forward = reshard
        # Where module order is not forward order (a unit outside the block stack), a prefetch only
        # gathers early: FSDP2 still waits for it.
        ordered = plan.units_in_forward_order(root)
        kept = {id(ordered[i][1]) for i in kept_units(len(ordered), keep_gathered)}
        for _, unit in plan.units:
            fully_shard(
                unit,
                mesh=mesh,
                reshard_after_forward=reshard and id(unit) not in kept,
                ignored_params=minority_dtype_params(unit) or None,
            )
        ignored = {p for _, module in plan.replicated for p in module.parameters()}
        ignored |= {p for p in minority_dtype_params(root) if p not in ignored}
        root_reshard = reshard and keep_gathered < 1
        fully_shard(root, mesh=mesh, reshard_after_forward=root_reshard, ignored_params=ignored or None)
        # FSDP2 keeps the root's weights gathered after forward by default, for a backward that
        # inference never runs; the root follows the same setting as its units instead.
        root.set_reshard_after_forward(root_reshard, recurse=False)
        named = [(name, m) for name, m in root.named_modules() if name and isinstance(m, FSDPModule)]
        #: ``(qualified name, module)`` of each unit in module order, then the root (``""``).
        self.unit_modules = named + [("", root)]
        self.root = root
        #: The units gathered for each forward, in module order.
        self.units = [m for _, m in named if id(m) not in kept]
        self._root_reshard = root_reshard
        self._kept = [m for _, m in named if id(m) in kept] + ([] if root_reshard else [root])
        if forward_prefetch > 0:
            for i, unit in enumerate(self.units[:-1]):
                unit.set_modules_to_forward_prefetch(self.units[i + 1 : i + 1 + forward_prefetch])

    def device_buffers(self) -> list[torch.Tensor]:
        """None besides the parameters: FSDP2 allocates its gathers per forward."""
        return []

    def before_sleep(self) -> None:
        """Frees every unit's gathered weights (kept units too: their next forward gathers them again,
        on every rank at the same tick, and keeps them), so that each module holds its shards alone."""
        for _, module in self.unit_modules:
            module.reshard()

    def activate(self) -> None:
        """Gathers the kept units; call once on every rank of the mesh, after the load (FSDP2
        hooked the forwards when it sharded)."""
        with torch.no_grad():
            for unit in self._kept:
                unit.unshard()

    def rejoined(self) -> None:
        """After the group's process groups were formed again (a mended group): every unit takes
        the new group of its mesh and drops what a forward cut short left (a gather under way, a
        unit left gathered, the root's forward marked as running).

        FSDP2 keeps the group it read at ``fully_shard`` and its forward's state in its own objects,
        with no public way to renew them; these are the fields it reads."""
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        for _, module in self.unit_modules:
            state = module._get_fsdp_state()
            state._state_ctx.iter_forward_root = None
            group = state._fsdp_param_group
            if group is None:
                continue
            for info in (group.mesh_info, group.post_forward_mesh_info):
                if info is not None and hasattr(info, "shard_process_group"):
                    info.shard_process_group = info.mesh.get_group(info.shard_mesh_dim)
            group._all_gather_result = None
            group._training_state = TrainingState.IDLE
        with torch.no_grad():
            for unit in [*self.units, *([self.root] if self._root_reshard else [])]:
                unit.reshard()

    @torch.no_grad()
    def ghost(self) -> None:
        """The collectives of one forward, in its order, without computing it."""
        self.root.unshard()  # a no-op for a kept root, as in its forward
        for unit in self.units:
            unit.unshard()
            if self.reshard_after_forward:
                unit.reshard()
        if self._root_reshard:
            self.root.reshard()


def shard_module(
    root: nn.Module,
    plan: ShardPlan,
    mesh: DeviceMesh,
    *,
    gather: str,
    reshard_after_forward: bool,
    forward_prefetch: int,
    keep_gathered: float = 0.0,
) -> FsdpUnits | InPlaceUnits:
    """Shards ``root`` (on the meta device) as ``plan`` says.

    Args:
        gather: ``"fsdp2"`` (``FsdpUnits``) or ``"in_place"`` (``InPlaceUnits``, which always
            frees a unit's gathered weights after its forward).
        reshard_after_forward: FSDP2's setting.
        forward_prefetch: Units whose gathers a unit's forward starts ahead.
        keep_gathered: Share of the units gathered once, when activated, and kept whole.
    """
    model_class = type(root).__name__  # fully_shard renames the class (FSDP<name>)
    if gather == "in_place":
        sharded = InPlaceUnits(root, plan, mesh, forward_prefetch, keep_gathered)
    elif gather == "fsdp2":
        sharded = FsdpUnits(root, plan, mesh, reshard_after_forward, forward_prefetch, keep_gathered)
    else:
        raise ValueError(f"gather must be 'fsdp2' or 'in_place' once resolved, got {gather!r}")
    logger.info("Sharded %d modules + root (%s, %s, %s gathers)", len(plan.units), model_class, plan.source, gather)
    return sharded


def compile_forward(module: nn.Module) -> None:
    """Compiles ``module``'s ``forward`` in place (regional compile of one block).

    ``forward``, not the module (``nn.Module.compile`` compiles ``_call_impl``, hooks included): the
    hooks around a block (FSDP2's and the in-place gathers, which are ``torch.compiler.disable``;
    step caches, which branch on data; diffusers' context-parallel splits) run as eager Python
    outside the compiled code, which dynamo neither traces nor guards on. The block's body is one
    graph, its attention kernels custom ops (``sharding.attention_ops``); a unit still gathers and
    frees its weights as in eager mode; ghost passes, which call no forward, are unchanged."""
    module.forward = torch.compile(module.forward)


def compile_units(sharded: FsdpUnits | InPlaceUnits) -> int:
    """Compiles each unit below the root in place (``compile_forward``).

    ``fully_shard`` renames the block classes, so diffusers' ``compile_repeated_blocks`` (which
    matches class names) finds nothing after sharding: the units themselves are compiled.

    Returns:
        The number of units compiled.
    """
    units = [m for name, m in sharded.unit_modules if name]
    for unit in units:
        compile_forward(unit)
    return len(units)


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of the classes ``model``'s ``_repeated_blocks`` names (as diffusers'
    ``compile_repeated_blocks`` finds them); none for a model that names none."""
    names = set(getattr(model, "_repeated_blocks", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def compile_repeated_blocks(model: nn.Module) -> int:
    """Compiles the repeated blocks of an unsharded ``model`` (``compile_forward``): those of the
    classes its ``_repeated_blocks`` names, as diffusers' ``compile_repeated_blocks`` finds them.

    Returns:
        The number of blocks compiled.

    Raises:
        ValueError: The model names no repeated blocks, or none is found.
    """
    blocks = repeated_blocks(model)
    if not blocks:
        raise ValueError(f"compile: {type(model).__name__} names no repeated blocks (_repeated_blocks) to compile")
    for block in blocks:
        compile_forward(block)
    return len(blocks)
