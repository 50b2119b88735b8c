"""CFG parallel: the conditional and unconditional forwards of a denoising step on two ranks at once.

A guided pipeline calls its transformer twice per step, conditional first, and uses the first
output only after the second call returns (the sharding policy's ``cfg_split`` says so for a
model). The stand-in therefore defers: the first call returns an empty tensor at once; at the
second call, CFG index 0 runs the first call's inputs and CFG index 1 the second's, at the same
tick, and the two outputs are exchanged; the conditional one is written into the deferred tensor
(``resize_`` + ``copy_``, so the pipeline's reference sees it) and the unconditional one returned.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


class CfgSplit:
    """The call a CFG-split module's stand-in makes instead of the runtime's ``call``.

    Args:
        call: The runtime's ``call(module_id, args, kwargs, context=None)``.
        half: ``half()`` on the calling request thread: ``(index, group)``, the CFG half this rank
            runs of the request's lane (0: conditional forwards, 1: unconditional) and the process
            group of the lane's two halves; ``None`` when the request's lane is not CFG-split
            (adaptive lanes of one rank).
        guided: Whether the request running on the calling thread makes an unconditional call
            at each step; without guidance every call runs as it is, on both halves.
    """

    def __init__(self, call: Callable, half: Callable[[], tuple | None], guided: Callable[[], bool]):
        self._call = call
        self._half = half
        self._guided = guided
        self._local = threading.local()  # the deferred first call of the request on this thread

    def __call__(self, module_id: int, args: tuple, kwargs: dict, context: dict | None = None):
        half = self._half()
        if half is None or not self._guided():
            return self._call(module_id, args, kwargs, context)
        if kwargs.get("return_dict", True):
            raise ValueError("CFG parallel defers a forward's result, which needs calls made with return_dict=False")
        pending = getattr(self._local, "pending", None)
        if pending is None:
            sample = kwargs.get("hidden_states", args[0] if args else None)
            deferred = torch.empty(0, dtype=sample.dtype, device=sample.device)
            self._local.pending = (module_id, args, kwargs, context, deferred)
            return (deferred,)
        self._local.pending = None
        first_module, first_args, first_kwargs, first_context, deferred = pending
        if first_module != module_id:
            raise RuntimeError(
                f"CFG parallel expected the unconditional call of module {first_module}, got module {module_id}"
            )
        # Each half runs its own call: its inputs and its cache context (cond or uncond).
        index, group = half
        mine = (first_args, first_kwargs, first_context) if index == 0 else (args, kwargs, context)
        cond, uncond = self._call(module_id, *mine[:2], context={**(mine[2] or {}), "cfg": group})
        if cond.dtype != deferred.dtype:
            raise RuntimeError(f"CFG parallel: the output is {cond.dtype}, the deferred result {deferred.dtype}")
        deferred.resize_(cond.shape).copy_(cond)
        return (uncond,)
