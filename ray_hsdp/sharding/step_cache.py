"""Step caches per request: diffusers' cache hooks on a rank's sharded transformers, with each
request's own cache state and settings.

diffusers keeps a cache hook's state per *context name* (``cond``, ``uncond``) on the module, and
its pipelines enter the context around each forward. Here a module serves several requests at
once, and forwards run on the tick thread: the stand-in a pipeline calls records the context on
the request's thread (``TickedModule.cache_context``), and the tick thread enters it around the
forward under a name of that request's own (``StepCaches.forward``), after setting the hooks to
the request's settings. A request's state is dropped when it ends, so requests never share it,
whatever their step counts, and a request after a cancelled one starts clean.

The hooks go on before ``fully_shard`` (diffusers recognises the blocks by class, which FSDP2
renames). FSDP2's gathers sit in a block's ``__call__`` and a cache replaces its ``forward``, so a
skipped block is still gathered and released: the collectives of a forward do not depend on the
cache, and ranks skipping different blocks stay in lock step. Inside a lane that splits the
sequence, a decision taken from activations must be the same on every rank (a skipped block runs
no attention all-to-all): First Block Cache's measure is reduced over the lane's sequence ranks
before it is compared. TaylorSeer's schedule agrees by construction.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn
from diffusers.hooks import FirstBlockCacheConfig, TaylorSeerCacheConfig
from diffusers.hooks.first_block_cache import (
    _ALL_TRANSFORMER_BLOCK_IDENTIFIERS,
    FBCHeadBlockHook,
    TransformerBlockRegistry,
)
from diffusers.hooks.taylorseer_cache import TaylorSeerCacheHook

from ray_hsdp.request import CACHE_KINDS, StepCache


def enable(module: nn.Module, kind: str, *, max_order: int = 1, lite: bool = True) -> bool:
    """Puts the hooks of ``kind`` on ``module`` (before it is sharded). Their per-request
    settings (threshold, schedule) are set before each forward by ``StepCaches``.

    Args:
        module: A diffusers model (built on the meta device or loaded).
        kind: One of ``CACHE_KINDS``.
        max_order: ``taylorseer``: the order of the Taylor expansion.
        lite: ``taylorseer``: predict the transformer's output projection and skip every block
            on a predicted step (diffusers' lite mode: a few MB of state per request), rather
            than predict each attention's output (GBs per request for a video).

    Returns:
        Whether the module took the hooks (only diffusers models with ``enable_cache`` do).
    """
    if kind not in CACHE_KINDS:
        raise ValueError(f"unknown cache kind {kind!r}; one of {', '.join(CACHE_KINDS)}")
    if not hasattr(module, "enable_cache"):
        return False
    if kind == "first_block":
        module.enable_cache(FirstBlockCacheConfig())
    else:
        dtype = next(module.parameters()).dtype
        module.enable_cache(TaylorSeerCacheConfig(max_order=max_order, taylor_factors_dtype=dtype, use_lite_mode=lite))
    return True


def blocks_known(module: nn.Module) -> bool:
    """Whether diffusers' First Block Cache knows the classes of ``module``'s transformer blocks:
    it finds them by the same names, and reads their outputs by its registry (which diffusers
    offers no public way to ask)."""
    blocks = {
        type(block)
        for name, child in module.named_children()
        if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, nn.ModuleList)
        for block in child
    }
    return all(_registered(block_class) for block_class in blocks)


def _registered(block_class: type) -> bool:
    try:
        TransformerBlockRegistry.get(block_class)
    except ValueError:  # its way of saying "not registered"
        return False
    return True


def _hooks(module: nn.Module) -> list:
    """The cache hooks under ``module``, in module order."""
    found = []
    for sub in module.modules():
        # diffusers keeps a module's hooks in this registry; it has no public way to list them.
        registry = sub.__dict__.get("_diffusers_hook")
        if registry is not None:
            found += [h for h in registry.hooks.values() if isinstance(h, (FBCHeadBlockHook, TaylorSeerCacheHook))]
    return found


#: The context of a forward without a cache: its state lives for that forward only (the tick thread
#: runs one forward at a time).
UNCACHED = "uncached"


class StepCaches:
    """The step-cache hooks of a rank's sharded modules, set per request at each forward.

    Args:
        modules: The rank's sharded root modules; those without cache hooks are left alone.
        sequence_groups: The process groups of the lane's ``ring`` and ``ulysses`` dims (those of
            more than one rank): First Block Cache's measure is summed over them.
    """

    def __init__(self, modules: Sequence[nn.Module], sequence_groups: Sequence = ()):
        self._hooks = {id(m): hooks for m in modules if (hooks := _hooks(m))}
        # Where each module's hooks keep their states (First Block Cache's hooks share one).
        self._managers = {
            key: list({id(h.state_manager): h.state_manager for h in hooks}.values())
            for key, hooks in self._hooks.items()
        }
        self._groups = list(sequence_groups)
        self._request_groups = self._groups  # the running forward's lane's (tick thread)
        self._settings: StepCache | None = None  # the request whose forward runs now (tick thread)
        self._lock = threading.Lock()
        self._contexts: dict[int, set[tuple[int, str]]] = {}  # request -> (module, context name)
        self._reused_by: dict[int, int] = {}  # request -> its forwards that reused the cache
        #: Forwards run with a step cache, and those of them that reused it, since the load.
        self.forwards = 0
        self.reused = 0
        for hooks in self._hooks.values():
            for hook in hooks:
                if isinstance(hook, FBCHeadBlockHook):
                    # An instance attribute: the hook calls its decision through self.
                    hook._should_compute_remaining_blocks = functools.partial(self._first_block_decision, hook)

    @contextmanager
    def forward(
        self,
        module: nn.Module,
        key: int,
        settings: StepCache | None,
        context: tuple[str, dict] | None,
        sequence_groups: Sequence | None = None,
    ) -> Iterator[None]:
        """On the tick thread, around one forward of ``module`` for one request.

        Args:
            module: The sharded module about to run.
            key: The request's key on this rank (its ticket), under which its state is kept.
            settings: The request's step cache; ``None``: every step computed in full.
            context: The ``(name, kwargs)`` of the pipeline's ``cache_context`` around the call.
            sequence_groups: The request's own lane's sequence groups (adaptive lanes); ``None``:
                the fixed lane's, given at construction.
        """
        hooks = self._hooks.get(id(module))
        if hooks is None:
            yield
            return
        self._request_groups = list(sequence_groups) if sequence_groups is not None else self._groups
        name, kwargs = context or ("default", {})
        self._configure(hooks, settings)
        if settings is None:
            # The hooks still run (they are on the module) and need a context; without a cache every
            # step computes in full, so what they keep is dropped after the forward, not kept until
            # the request ends.
            try:
                with module.cache_context(UNCACHED, **kwargs):
                    yield
            finally:
                for manager in self._managers[id(module)]:
                    manager._state_cache.pop(UNCACHED, None)
            return
        context_name = f"{key}/{name}"
        with self._lock:
            self._contexts.setdefault(key, set()).add((id(module), context_name))
        with module.cache_context(context_name, **kwargs):
            yield
            reused = self._reused(hooks)
        with self._lock:
            self.forwards += 1
            self.reused += reused
            self._reused_by[key] = self._reused_by.get(key, 0) + reused

    def release(self, key: int) -> int:
        """Drops the cache state of the request of ``key`` once it ended (on its own thread: none
        of its forwards runs any more).

        Returns:
            Its forwards that reused the cache.
        """
        with self._lock:
            contexts = self._contexts.pop(key, set())
            reused = self._reused_by.pop(key, 0)
        for module_id, name in contexts:
            for manager in self._managers[module_id]:
                # diffusers frees states only all at once (reset), which would drop the states of
                # the requests still running; each request's state is its own entry.
                manager._state_cache.pop(name, None)
        return reused

    def _configure(self, hooks, settings: StepCache | None) -> None:
        self._settings = settings
        for hook in hooks:
            if isinstance(hook, TaylorSeerCacheHook):
                # Without a cache every step is a warm-up step: computed in full.
                hook.cache_interval = settings.interval if settings else 1
                hook.disable_cache_before_step = settings.warmup_steps if settings else sys.maxsize
                hook.disable_cache_after_step = settings.full_after_step if settings else None

    @staticmethod
    def _reused(hooks) -> bool:
        """Whether the forward that just ran (its context still set) reused the cache."""
        hook = hooks[0]
        if isinstance(hook, FBCHeadBlockHook):
            return not hook.state_manager.get_state().should_compute
        active = next((h for h in hooks if not h.state_manager.get_state().is_inactive), hook)
        state = active.state_manager.get_state()
        return state.last_update_step != state.current_step

    def _first_block_decision(self, hook: FBCHeadBlockHook, residual: torch.Tensor) -> bool:
        """First Block Cache's choice for the running request: without a cache, always compute;
        in a lane that splits the sequence, the relative change over the whole sequence."""
        settings = self._settings
        if settings is None:
            return True
        hook.threshold = settings.threshold
        if not self._request_groups:
            return FBCHeadBlockHook._should_compute_remaining_blocks(hook, residual)
        previous = hook.state_manager.get_state().head_block_residual
        if previous is None:
            return True
        sums = torch.stack([(residual - previous).abs().sum(), previous.abs().sum()]).float()
        for group in self._request_groups:
            dist.all_reduce(sums, group=group)
        return (sums[0] / sums[1]).item() > settings.threshold
