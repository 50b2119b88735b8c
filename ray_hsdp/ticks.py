"""The tick protocol: ranks of a group agree, before every forward of a sharded root module, on
which modules run, so any mix of requests issues the same collectives in the same order.

Before a rank calls a sharded root module (text encoder, transformer, second expert) it
all-gathers that module's id; an idle rank all-gathers ``IDLE``. For each distinct id, in
ascending order, a rank runs its real forward if the id is its own and otherwise a *ghost pass*
of that module: the unshard / reshard sequence of its FSDP units with no compute. Every rank thus
issues, per tick, the all-gathers of the same modules in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

IDLE = -1


class TickProtocol:
    """Installs tick hooks on a rank's sharded root modules and runs idle ticks.

    Args:
        modules: Name -> sharded root module; every rank passes the same names.
        device: ``"cuda"`` or ``"cpu"``: where the tick's all-gather tensor lives.
        reshard_after_forward: Whether units (and roots) free gathered weights after forward;
            a ghost pass must leave each unit in the state a real forward leaves it in.
        group: Process group (the default one when ``None``).
    """

    def __init__(self, modules: dict[str, nn.Module], device: str, reshard_after_forward: bool, group=None):
        self.names = sorted(modules)
        self.modules = [modules[name] for name in self.names]
        self.device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        self.reshard_after_forward = reshard_after_forward
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.units = [self._units_in_forward_order(m) for m in self.modules]
        self.ticks = 0
        self.ghosts = 0
        self._after: list[list[int]] = []
        self._handles = []
        for module_id, module in enumerate(self.modules):
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(module_id), prepend=True))
            self._handles.append(module.register_forward_hook(self._post_hook()))

    @staticmethod
    def _units_in_forward_order(root: nn.Module) -> list[FSDPModule]:
        # Diffusion transformers and text encoders call their blocks in registration order.
        return [m for name, m in root.named_modules() if name and isinstance(m, FSDPModule)]

    def _gather(self, module_id: int) -> list[int]:
        mine = torch.tensor([module_id], dtype=torch.int64, device=self.device)
        everyone = torch.empty(self.world_size, dtype=torch.int64, device=self.device)
        dist.all_gather_into_tensor(everyone, mine, group=self.group)
        self.ticks += 1
        return everyone.tolist()

    def _pre_hook(self, module_id: int):
        def hook(module, args):
            others = sorted(set(self._gather(module_id)) - {IDLE, module_id})
            for other in others:
                if other < module_id:
                    self.ghost(other)
            self._after.append([other for other in others if other > module_id])

        return hook

    def _post_hook(self):
        def hook(module, args, output):
            for other in self._after.pop():
                self.ghost(other)

        return hook

    @torch.no_grad()
    def ghost(self, module_id: int) -> None:
        """The collectives of one forward of module ``module_id``, without its compute."""
        root = self.modules[module_id]
        root.unshard()
        for unit in self.units[module_id]:
            unit.unshard()
            if self.reshard_after_forward:
                unit.reshard()
        if self.reshard_after_forward:
            root.reshard()
        self.ghosts += 1

    def idle_tick(self) -> bool:
        """One tick of a rank without work: ghost passes of what the others run.

        Returns:
            True when every rank was idle at this tick (all ranks see the same answer).
        """
        gathered = self._gather(IDLE)
        for other in sorted(set(gathered) - {IDLE}):
            self.ghost(other)
        return all(g == IDLE for g in gathered)

    def remove(self) -> None:
        """Takes the hooks off the modules."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
