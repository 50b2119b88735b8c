"""Running several requests' calls of one module as one batched forward, and splitting the result.

A sharded forward pays for gathering the module's weights once, whatever its batch: two
requests' transformer calls run as one forward pay it once instead of twice. Calls batch only
when that is plainly safe: every tensor argument has the call's batch size as its first
dimension and the same remaining shape, dtype and device as the other call's, and every other
argument is equal. Anything else (a tensor without a batch dimension, tensors nested in
containers) runs alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _values(args: tuple, kwargs: dict) -> list:
    return [*args, *(kwargs[k] for k in sorted(kwargs))]


def batch_size(args: tuple, kwargs: dict) -> int | None:
    """The first dimension of the call's first tensor argument; ``None`` without one."""
    first = next((v for v in _values(args, kwargs) if isinstance(v, torch.Tensor)), None)
    return int(first.shape[0]) if first is not None and first.dim() >= 1 else None


def compatible(a: tuple[tuple, dict], b: tuple[tuple, dict]) -> bool:
    """Whether calls ``a`` and ``b`` (each ``(args, kwargs)``) can run as one batched forward."""
    (args_a, kwargs_a), (args_b, kwargs_b) = a, b
    if len(args_a) != len(args_b) or sorted(kwargs_a) != sorted(kwargs_b):
        return False
    size_a, size_b = batch_size(*a), batch_size(*b)
    if size_a is None or size_b is None:
        return False
    for x, y in zip(_values(args_a, kwargs_a), _values(args_b, kwargs_b)):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
                return False
            if x.dim() == 0 or x.shape[0] != size_a or y.shape[0] != size_b:
                return False
            if x.shape[1:] != y.shape[1:] or x.dtype != y.dtype or x.device != y.device:
                return False
            continue
        try:
            if not bool(x == y):
                return False
        except Exception:  # noqa: BLE001 - containers of tensors and the like do not batch
            return False
    return True


def concatenate(calls: Sequence[tuple[tuple, dict]]) -> tuple[tuple, dict, list[int]]:
    """One call made of ``calls`` (already ``compatible``): tensors joined on dim 0.

    Returns:
        The batched args and kwargs, and each call's batch size.
    """
    first_args, first_kwargs = calls[0]

    def join(values):
        return torch.cat(values, dim=0) if isinstance(values[0], torch.Tensor) else values[0]

    args = tuple(join([c[0][i] for c in calls]) for i in range(len(first_args)))
    kwargs = {k: join([c[1][k] for c in calls]) for k in first_kwargs}
    return args, kwargs, [batch_size(*c) for c in calls]


def split(output, sizes: list[int]) -> list:
    """Splits a batched forward's output into one output per call.

    Tensors must carry the whole batch on dim 0; tuples, lists, dicts and diffusers or
    transformers output classes are split field by field; anything else is shared.

    Raises:
        ValueError: A tensor of the output has no batch dimension to split.
    """
    total = sum(sizes)
    if isinstance(output, torch.Tensor):
        if output.dim() == 0 or output.shape[0] != total:
            raise ValueError(f"cannot split an output of shape {tuple(output.shape)} into batches of {sizes}")
        return list(torch.split(output, sizes, dim=0))
    if isinstance(output, dict):  # diffusers BaseOutput and transformers ModelOutput are dicts
        fields = {k: split(v, sizes) for k, v in output.items()}
        return [type(output)(**{k: parts[i] for k, parts in fields.items()}) for i in range(len(sizes))]
    if isinstance(output, (tuple, list)):
        parts = [split(v, sizes) for v in output]
        return [type(output)(p[i] for p in parts) for i in range(len(sizes))]
    return [output] * len(sizes)
