"""The real side of the runtime's seams: sharded root modules and the tick's all-gather over a
torch process group."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn

from ray_hsdp.runtime.batching import concatenate, split
from ray_hsdp.runtime.core import ForwardCall
from ray_hsdp.variant import NO_REQUEST, RankFeatures


def _tensors(obj):
    """The tensors inside a module's output (tensor, tuple, list, dict or diffusers/transformers output)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):  # BaseOutput and ModelOutput are dicts too
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (tuple, list)):
        for value in obj:
            yield from _tensors(value)


class _Slot:
    """Where a tensor stood in a structure sent without its tensors (``_without_tensors``)."""


def _without_tensors(obj, tensors: list):
    """``(obj with each tensor replaced by a _Slot, [(shape, dtype)] in order)``; the tensors
    (contiguous) appended to ``tensors``. Structures: tuples, lists and dicts."""
    shapes: list = []

    def strip(value):
        if isinstance(value, torch.Tensor):
            tensors.append(value.contiguous())
            shapes.append((tuple(value.shape), value.dtype))
            return _Slot()
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items()}
        if isinstance(value, (tuple, list)):
            return type(value)(strip(v) for v in value)
        return value

    return strip(obj), shapes


def _with_tensors(obj, tensors):
    """``obj`` with its slots filled from the iterator ``tensors``, in order."""
    if isinstance(obj, _Slot):
        return next(tensors)
    if isinstance(obj, dict):
        return {k: _with_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_with_tensors(v, tensors) for v in obj)
    return obj


def broadcast_inputs(inputs, group, source: int, device: torch.device):
    """``inputs`` (tuples, lists and dicts of tensors and picklable values) of the rank ``source``
    of ``group`` (its index there), on every rank of ``group``: the structure and the tensors'
    shapes first, in one object broadcast, then each tensor. Each rank passes its own ``inputs``;
    only the source's are read."""
    tensors: list[torch.Tensor] = []
    sends = dist.get_rank(group) == source
    box = [_without_tensors(inputs, tensors) if sends else None]
    dist.broadcast_object_list(box, group=group, group_src=source, device=device)
    structure, shapes = box[0]
    if not sends:
        tensors = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in shapes]
    for tensor in tensors:
        dist.broadcast(tensor, group=group, group_src=source)
    return _with_tensors(structure, iter(tensors))


class TickedModule:
    """Stands in a pipeline for a sharded root module: calls go to the tick thread, attributes
    (``config``, ``dtype``, ...) to the module itself.

    A pipeline's ``cache_context`` is kept for the calls its thread makes inside it, and entered
    by the tick thread around their forwards (``ray_hsdp.sharding.step_cache``): entered here it would set
    the hooks' context of a module that runs other requests' forwards meanwhile.
    """

    def __init__(self, module: nn.Module, module_id: int, call: Callable[..., object]):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_module_id", module_id)
        object.__setattr__(self, "_call", call)
        object.__setattr__(self, "_local", threading.local())

    def __call__(self, *args, **kwargs):
        cache = getattr(self._local, "cache", None)
        return self._call(self._module_id, args, kwargs, {"cache": cache} if cache is not None else None)

    @contextmanager
    def cache_context(self, name: str, **kwargs):
        """diffusers' ``cache_context`` for the calls this thread makes inside it."""
        previous = getattr(self._local, "cache", None)
        self._local.cache = (name, kwargs)
        try:
            yield
        finally:
            self._local.cache = previous

    def _reset_stateful_cache(self, recurse: bool = True) -> None:
        """A no-op: diffusers resets every cache state of a component when a pipeline call ends,
        which here would drop those of the requests still running; a request's own state is
        dropped when it ends (``StepCaches.release``)."""

    def __getattr__(self, name):
        return getattr(self._module, name)


#: A CUDA stream priority below every device's range: torch maps it to the highest the device has.
HIGHEST_PRIORITY = -100


def priority_stream() -> torch.cuda.Stream:
    """A CUDA stream of the device's highest priority: the tick thread's forwards run on it beside
    request streams (``request_streams``), so that the GPU's block scheduler gives a rank's part of
    the group's lock step precedence over that rank's own decode, which the other ranks never wait
    for. (At equal priority the decode's kernels take SMs from the forward, and every rank of the
    group waits at the next tick for the slowed one.)"""
    return torch.cuda.Stream(priority=HIGHEST_PRIORITY)


class ShardedModules:
    """A rank's sharded root modules (text encoders, transformers), numbered smallest first.

    Args:
        modules: Name -> sharded root module; every rank passes the same names.
        device: ``"cuda"`` or ``"cpu"``.
        shardings: Name -> how the module is sharded (``FsdpUnits`` or ``InPlaceUnits``): its
            units in forward order and its ghost pass (the collectives of one forward, in its
            order, leaving the module as a real forward leaves it).
        features: What the rank loaded for per-request features (``ray_hsdp.variant.RankFeatures``:
            adapters, step caches): each forward runs inside its request's variant
            (``RequestVariant.forward``), which applies the request's choices to them.
        stream: CUDA stream the forwards and ghost passes run on (``priority_stream``); ``None``:
            the tick thread's current one.
    """

    def __init__(
        self,
        modules: dict[str, nn.Module],
        device: str,
        shardings: dict,
        features: RankFeatures | None = None,
        stream: torch.cuda.Stream | None = None,
    ):
        self.features = features or RankFeatures()
        self.stream = stream
        # Parameter counts are global (DTensor), so every rank gets the same order.
        self.names = sorted(modules, key=lambda n: (sum(p.numel() for p in modules[n].parameters()), n))
        self.modules = [modules[name] for name in self.names]
        self.cuda = device == "cuda"
        self.units = [[m for name, m in shardings[n].unit_modules if name] for n in self.names]
        self.ghosts = [shardings[n].ghost for n in self.names]

    def proxies(
        self, call: Callable[[int, tuple, dict], object], overrides: dict[str, Callable] | None = None
    ) -> dict[str, TickedModule]:
        """Name -> the stand-in a pipeline calls instead of the module.

        Args:
            call: The runtime's ``call``.
            overrides: Name -> the call to use instead for that module (the CFG split).
        """
        overrides = overrides or {}
        return {
            name: TickedModule(module, i, overrides.get(name, call))
            for i, (name, module) in enumerate(zip(self.names, self.modules))
        }

    def before_call(self, call: ForwardCall) -> None:
        if self.cuda:
            # The caller may run on a stream of its own (decoding beside the forwards): the tick
            # thread's stream starts the forward once the inputs are ready on it.
            ready = torch.cuda.Event()
            ready.record()
            call.context.update(stream=torch.cuda.current_stream(), ready=ready)

    @torch.no_grad()
    def forward(self, calls: list[ForwardCall]) -> list:
        with torch.cuda.stream(self.stream):  # a no-op for None
            return self._forward(calls)

    def _forward(self, calls: list[ForwardCall]) -> list:
        for call in calls:
            if "ready" in call.context:
                torch.cuda.current_stream().wait_event(call.context["ready"])
        module = self.modules[calls[0].module_id]
        if "widened" in calls[0].context:  # one call: lanes of several ranks run no batches
            self._share_inputs(calls[0])
        # A batch's calls share their batch key (adapters, step cache): the first one's variant
        # stands for all; a widened call runs it on its wider lane.
        variant = calls[0].request or NO_REQUEST
        if calls[0].request is not None and calls[0].ticket != variant.ticket:
            variant = variant.with_ticket(calls[0].ticket)
        with variant.forward(module, calls[0].context.get("cache"), self.features):
            if len(calls) == 1:
                results = [module(*calls[0].args, **calls[0].kwargs)]
            else:
                args, kwargs, sizes = concatenate([(c.args, c.kwargs) for c in calls])
                results = split(module(*args, **kwargs), sizes)
        if calls[0].context.get("cfg") is not None:  # one call: lanes of several ranks run no batches
            results = [self._exchange_cfg(results[0], calls[0].context["cfg"])]
        finished = None
        for call, result in zip(calls, results):
            stream = call.context.get("stream")
            if stream is not None and stream != torch.cuda.current_stream():
                # The caller's stream reads the outputs later: their memory must not return to
                # this stream's pool before it has.
                for tensor in _tensors(result):
                    tensor.record_stream(stream)
                if finished is None:
                    finished = torch.cuda.Event()
                    finished.record()
                call.context["finished"] = finished
        return results

    def _share_inputs(self, call: ForwardCall) -> None:
        """A widened call's inputs, from its wider lane's source rank to the lane's other ranks
        (``runtime.widening``)."""
        size, source = call.context["widened"]
        group = self.features.lane_parallel.sequence_groups(size)[0]
        device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        call.args, call.kwargs, cache = broadcast_inputs(
            (call.args, call.kwargs, call.context.get("cache")), group, source, device
        )
        if cache is not None:
            call.context["cache"] = cache

    def _exchange_cfg(self, output, group) -> tuple[torch.Tensor, torch.Tensor]:
        """All-gathers a forward's prediction between the lane's two CFG halves (``group``, which
        the CFG split's call carries in its context).

        Returns:
            ``(conditional, unconditional)``: the outputs of CFG index 0 and 1.
        """
        tensor = output if isinstance(output, torch.Tensor) else output[0]
        tensor = tensor.contiguous()
        n = tensor.shape[0]
        both = torch.empty((2 * n, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        dist.all_gather_into_tensor(both, tensor, group=group)
        return both[:n], both[n:]

    def after_call(self, call: ForwardCall) -> None:
        if "finished" in call.context:
            call.context["stream"].wait_event(call.context["finished"])

    def ghost(self, module_id: int) -> None:
        with torch.cuda.stream(self.stream):
            self.ghosts[module_id]()


class ProcessGroupExchange:
    """The tick's all-gather of one integer per rank over a torch process group.

    Args:
        device: ``"cuda"`` or ``"cpu"``: where the gathered tensor lives (NCCL needs cuda).
        group: The process group; the default one when ``None``.
    """

    def __init__(self, device: str, group=None):
        self.device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        self.group = group
        self.world_size = dist.get_world_size(group)

    def __call__(self, state: int) -> list[int]:
        mine = torch.tensor([state], dtype=torch.int64, device=self.device)
        everyone = torch.empty(self.world_size, dtype=torch.int64, device=self.device)
        dist.all_gather_into_tensor(everyone, mine, group=self.group)
        return everyone.tolist()
