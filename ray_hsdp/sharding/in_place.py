"""Sharded units gathered in place: each parameter's all-gather lands in a persistent buffer that the
module's parameter views, with nothing copied in or out.

FSDP2 gathers a unit as one flat buffer: it copies the unit's shards into its send buffer and,
after the all-gather, copies each parameter out of the received buffer, which is laid out rank by
rank. That is two passes over the weights of a model per forward on every rank: a 14B Wan
transformer at S=2 on H100 spends +54 ms of copy kernels per 0.65 s forward
(bench/results/profile-wan2.1-t2v-14b-2xH100-21f8s.md). A parameter sharded on dim 0 needs
neither pass: the all-gather of its own rows arrives rank-major, which is the full parameter's
layout. The flat buffer serves training (gradients, reduce-scatter, mixed precision); inference
has none of it.

Units take turns in ``prefetch + 1`` buffer slots (unit ``i`` uses slot ``i mod (prefetch + 1)``),
so the gathered weights held at any time are those of ``prefetch + 1`` units and the root, as with
FSDP2's reshard after forward and explicit prefetch; the buffers are allocated once, after the
load. A unit's gathers are issued from the compute stream, so NCCL starts them only after the
kernels already queued there, among them those of the unit that used the slot before.

Units that stay gathered (``keep_gathered``) have buffers of their own, gathered once when the
units are activated: their forwards gather nothing, and a ghost pass skips them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ray_hsdp.sharding.layout import rows_of, rows_per_rank
from ray_hsdp.sharding.policy import ShardPlan, minority_dtype

#: Bytes every gathered parameter's view is aligned to inside its slot.
_ALIGN = 256


@dataclass
class _Param:
    """One sharded parameter: its DTensor at rest and, once activated, where it is gathered."""

    owners: list[tuple[nn.Module, str]]  # (module, attribute): tied parameters have several
    sharded: nn.Parameter
    send: torch.Tensor | None = None  # this rank's rows, padded to the shard's row count
    receive: torch.Tensor | None = None  # world x padded rows: the first rows are the parameter
    gathered: nn.Parameter | None = None

    @property
    def wire(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(receive, send)`` as the collective takes them: FP8 as bytes (gloo has no FP8 type)."""
        if self.send.dtype.is_floating_point and self.send.element_size() == 1:
            return self.receive.view(torch.uint8), self.send.view(torch.uint8)
        return self.receive, self.send

    @property
    def rows(self) -> int:
        return self.sharded.shape[0]

    def receive_bytes(self, world: int) -> int:
        padded = rows_per_rank(self.rows, world) * world
        return padded * math.prod(self.sharded.shape[1:]) * self.sharded.element_size()


@dataclass
class _Unit:
    name: str
    module: nn.Module
    params: list[_Param] = field(default_factory=list)
    slot: int = -1  # -1: the root's own buffer

    def swap(self, attribute: str) -> None:
        for param in self.params:
            value = getattr(param, attribute)
            for module, name in param.owners:
                setattr(module, name, value)


def _shardable(module: nn.Module, skip: set[int]) -> list[tuple[nn.Parameter, list[tuple[nn.Module, str]]]]:
    """``module``'s parameters that shard, with every (module, name) that holds each.

    Parameters in ``skip``, scalars and parameters of a minority dtype stay whole (a library keeps
    norms or modulation tables in float32 inside a bfloat16 model; FSDP2 leaves them out too).
    """
    found: dict[int, tuple[nn.Parameter, list]] = {}
    for _, owner in module.named_modules():
        for name, p in owner.named_parameters(recurse=False):
            if id(p) in skip or p.dim() == 0:
                continue
            found.setdefault(id(p), (p, []))[1].append((owner, name))
    whole = {id(p) for p in minority_dtype([p for p, _ in found.values()])}
    return [(p, owners) for p, owners in found.values() if id(p) not in whole]


class InPlaceUnits:
    """A root module's units, sharded on dim 0 and gathered in place for each forward.

    Build it on the meta model (its parameters become DTensors: what the loader fills and the
    memory report counts), materialise and load the model, then call ``activate`` once. A model
    built for real keeps each rank's rows of its weights.

    Args:
        root: The model, on the meta device or built.
        plan: Its units and the submodules that stay replicated; units must not nest.
        mesh: The group's 1-D ``shard`` mesh.
        prefetch: Units whose gathers a unit's forward issues ahead of its own compute.
        keep_gathered: Share of the units gathered once and kept whole (``kept_units`` picks
            them); 1 keeps the root too, so that a forward gathers nothing.

    Raises:
        ValueError: A unit of the plan holds another.
    """

    def __init__(self, root: nn.Module, plan: ShardPlan, mesh: DeviceMesh, prefetch: int, keep_gathered: float = 0.0):
        self.mesh = mesh
        self.group = mesh.get_group()
        self.world = mesh.size()
        self.prefetch = prefetch
        in_plan = {id(m): name for name, m in plan.units}
        for name, unit in plan.units:
            for inner_name, inner in unit.named_modules():
                if inner_name and id(inner) in in_plan:
                    raise ValueError(f"in-place gathers need units that do not nest: {name} holds {in_plan[id(inner)]}")
        replicated = {id(p) for _, m in plan.replicated for p in m.parameters()}
        ordered = plan.units_in_forward_order(root)
        kept = kept_units(len(ordered), keep_gathered)
        #: Every unit in forward order: those gathered per forward and those kept whole.
        self.all_units = [_Unit(name, m, self._shard(_shardable(m, replicated))) for name, m in ordered]
        #: The units gathered for each forward; unit ``i`` of them gathers into slot ``i mod (prefetch + 1)``.
        self.units = [u for i, u in enumerate(self.all_units) if i not in kept]
        for i, unit in enumerate(self.units):
            unit.slot = i % (prefetch + 1)
        self.kept = [u for i, u in enumerate(self.all_units) if i in kept]
        for i, unit in enumerate(self.kept):
            unit.slot = -2 - i  # a buffer of its own
        in_units = {id(p) for _, m in ordered for p in m.parameters()}  # the units' parameters as sharded
        self.root = _Unit("", root, self._shard(_shardable(root, replicated | in_units)))
        self.root_kept = keep_gathered >= 1
        self._slots: list[torch.Tensor] = []
        self._kept_weight_bytes = 0
        self._coalesce = False  # set by activate: NCCL coalesces, gloo has no coalesced all-gather
        self._pending: dict[int, list] = {}
        self._index = {id(u.module): i for i, u in enumerate(self.units)}

    def _shard(self, params) -> list[_Param]:
        out = []
        for p, owners in params:
            mine = rows_of(p.shape[0], self.world, self.mesh.get_local_rank())
            if p.is_meta:
                local = torch.empty((mine.stop - mine.start, *p.shape[1:]), dtype=p.dtype, device="meta")
            else:  # a model built for real: keep this rank's rows
                local = p.detach()[mine].clone()
            sharded = nn.Parameter(
                DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride()),
                requires_grad=False,
            )
            for module, name in owners:
                setattr(module, name, sharded)
            out.append(_Param(owners, sharded))
        return out

    @property
    def unit_modules(self) -> list[tuple[str, nn.Module]]:
        """``(qualified name, module)`` of each unit in forward order, then the root (``""``)."""
        return [(u.name, u.module) for u in self.all_units] + [("", self.root.module)]

    @property
    def buffer_bytes(self) -> int:
        """Device bytes of the gather buffers the units take in turn (slots and the root's) and the
        padding of the kept units' own; their whole weights are ``kept_bytes``."""
        return sum(b.numel() for b in self._slots) - self._kept_weight_bytes

    @property
    def kept_bytes(self) -> int:
        """Device bytes of the kept units' whole weights (in buffers of their own, held at all
        times). The modules see them as plain tensors, so a count of parameters takes them for
        replicated ones."""
        return self._kept_weight_bytes

    def device_buffers(self) -> list[torch.Tensor]:
        """The buffers the units hold besides their modules' parameters: the gather slots (the kept
        units' whole weights among them) and every unit's shards (a kept unit's module holds its
        whole weights instead): what a sleep parks with the parameters."""
        shards = [p.sharded.to_local() for unit in [*self.all_units, self.root] for p in unit.params]
        return [*self._slots, *shards]

    def before_sleep(self) -> None:
        """Nothing to free: between forwards every unit holds its sharded parameters."""

    def activate(self) -> None:
        """Allocates the gather buffers, gathers the kept units and hooks the forwards; call once
        on every rank of the mesh, after the load."""
        every = [*self.all_units, self.root]
        for unit in every:
            for param in unit.params:  # materialising the model replaced the meta parameters
                module, name = param.owners[0]
                param.sharded = getattr(module, name)
        sizes: dict[int, int] = {}
        for unit in every:
            need = sum(_aligned(p.receive_bytes(self.world)) for p in unit.params)
            sizes[unit.slot] = max(sizes.get(unit.slot, 0), need)
        any_param = next((p for u in every for p in u.params), None)
        if any_param is None:
            return
        device = any_param.sharded.to_local().device
        self._coalesce = device.type == "cuda"
        buffers = {slot: torch.empty(size, dtype=torch.uint8, device=device) for slot, size in sizes.items()}
        self._slots = list(buffers.values())
        for unit in every:
            offset = 0
            for param in unit.params:
                self._place(param, buffers[unit.slot], offset)
                offset += _aligned(param.receive_bytes(self.world))
        kept = self.kept + ([self.root] if self.root_kept else [])
        self._kept_weight_bytes = sum(p.gathered.numel() * p.gathered.element_size() for u in kept for p in u.params)
        for unit in kept:
            self._gather_now(unit)
            unit.swap("gathered")
            for param in unit.params:  # the whole weight holds this rank's rows: the shard goes
                param.sharded = param.send = None
        for unit in self.units:
            unit.module.register_forward_pre_hook(self._before_unit)
            unit.module.register_forward_hook(self._after_unit)
        self.root.module.register_forward_pre_hook(self._before_root)
        self.root.module.register_forward_hook(self._after_root)

    def _place(self, param: _Param, buffer: torch.Tensor, offset: int) -> None:
        shape = param.sharded.shape
        padded_rows = rows_per_rank(shape[0], self.world)
        nbytes = param.receive_bytes(self.world)
        param.receive = (
            buffer[offset : offset + nbytes].view(param.sharded.dtype).view(padded_rows * self.world, *shape[1:])
        )
        param.gathered = nn.Parameter(param.receive[: shape[0]], requires_grad=False)
        local = param.sharded.to_local()
        if local.shape[0] == padded_rows and local.is_contiguous():
            param.send = local
            return
        # Uneven rows: this rank's rows live in a padded tensor from now on, the DTensor views them.
        param.send = torch.zeros((padded_rows, *shape[1:]), dtype=local.dtype, device=local.device)
        param.send[: local.shape[0]].copy_(local)
        sharded = nn.Parameter(
            DTensor.from_local(
                param.send[: local.shape[0]],
                self.mesh,
                [Shard(0)],
                run_check=False,
                shape=shape,
                stride=param.sharded.stride(),
            ),
            requires_grad=False,
        )
        param.sharded = sharded
        for module, name in param.owners:
            setattr(module, name, sharded)

    # ---- the gathers ---------------------------------------------------------------------

    def _start(self, unit: _Unit) -> list:
        """Starts ``unit``'s gathers; returns what to wait on."""
        if not self._coalesce:
            return [dist.all_gather_into_tensor(*p.wire, group=self.group, async_op=True) for p in unit.params]
        # One NCCL group launch for the unit instead of one kernel per parameter.
        with dist._coalescing_manager(group=self.group, async_ops=True) as gathers:
            for p in unit.params:
                dist.all_gather_into_tensor(*p.wire, group=self.group)
        return [gathers]

    def _gather_now(self, unit: _Unit) -> None:
        for work in self._start(unit):
            work.wait()

    def _issue(self, key: int) -> None:
        """Starts the gathers of unit ``key`` (-1: the root) unless they are under way."""
        if key in self._pending or key >= len(self.units) or (key < 0 and self.root_kept):
            return
        self._pending[key] = self._start(self.root if key < 0 else self.units[key])

    def _wait(self, key: int) -> None:
        """Makes the current stream wait for unit ``key``'s gathers, issuing them first if needed."""
        self._issue(key)
        for work in self._pending.pop(key, ()):
            work.wait()

    def _drain(self) -> None:
        """Waits for gathers left over by a forward that ended early (it raised, or skipped units)."""
        for key in sorted(self._pending):
            self._wait(key)

    @torch.compiler.disable
    def _before_root(self, module, args) -> None:
        self._drain()
        self._issue(-1)
        for key in range(self.prefetch):
            self._issue(key)
        self._wait(-1)
        if not self.root_kept:
            self.root.swap("gathered")

    @torch.compiler.disable
    def _after_root(self, module, args, output) -> None:
        if not self.root_kept:
            self.root.swap("sharded")

    @torch.compiler.disable
    def _before_unit(self, module, args) -> None:
        key = self._index[id(module)]
        self._wait(key)
        for ahead in range(key + 1, key + 1 + self.prefetch):
            self._issue(ahead)
        self.units[key].swap("gathered")

    @torch.compiler.disable
    def _after_unit(self, module, args, output) -> None:
        self.units[self._index[id(module)]].swap("sharded")

    def rejoined(self) -> None:
        """After the group's process groups were formed again (a mended group): gathers go over the
        mesh's new group, and a forward cut short leaves nothing behind (its gathers under way are
        dropped, its units read their shards again)."""
        self.group = self.mesh.get_group()
        self._pending = {}
        for unit in self.units:
            unit.swap("sharded")
        if not self.root_kept:
            self.root.swap("sharded")

    @torch.no_grad()
    def ghost(self) -> None:
        """The collectives of one forward, in its order, without computing it."""
        self._drain()
        self._wait(-1)
        for key in range(len(self.units)):
            self._wait(key)


def kept_units(count: int, share: float) -> set[int]:
    """Which of ``count`` units (forward order) stay gathered: ``round(share * count)`` of them,
    spread evenly, so that the units still gathered per forward have kept units' compute between
    them to hide behind.

    >>> sorted(kept_units(8, 0.5)), sorted(kept_units(8, 0.25)), sorted(kept_units(4, 1.0))
    ([1, 3, 5, 7], [3, 7], [0, 1, 2, 3])
    """
    keep = round(share * count)
    return {(i + 1) * count // keep - 1 for i in range(keep)} if keep else set()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN
