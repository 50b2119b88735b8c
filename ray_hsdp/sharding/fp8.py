"""FP8 linears for in-place gathered units: weights stored, gathered and multiplied in FP8.

Each rank quantizes its own rows of a unit's linear weights once, after the load: one scale per
output row (row-wise scaling), so a rank needs no other rank's rows to quantize its own, and the
gathered weight is byte for byte the weight the unsharded model would quantize. The shards and the
gathers are then half their bfloat16 size. Each forward scales its activations per token and
multiplies with ``torch._scaled_mm`` (row-wise scales, bfloat16 out): the only FP8 matmul torch
offers on the CUDA hosts we serve on (torch 2.11; ``torch.nn.functional.scaled_mm`` takes its
recipe as a private enum). FP8 matmuls need tensor cores of compute capability 8.9 or above.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from ray_hsdp.sharding.layout import rows_per_rank
from ray_hsdp.sharding.policy import ShardPlan

#: The FP8 format of weights and activations: e4m3 (more mantissa; forward passes need no e5m2 range).
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
#: ``_scaled_mm`` wants both matrix sides that it contracts or returns as multiples of 16.
_ALIGN = 16
#: The smallest CUDA compute capability with FP8 tensor cores (Ada; Hopper is 9.0).
MIN_CAPABILITY = (8, 9)


def check_fp8_device(device: str) -> None:
    """Raises ``ValueError`` unless ``device`` is a CUDA GPU with FP8 tensor cores."""
    if device != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"quantization 'fp8' needs a CUDA GPU with FP8 tensor cores; this rank runs on {device}")
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name()
        raise ValueError(
            f"quantization 'fp8' needs FP8 tensor cores (compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
            f"or above: H100, L40S); this rank's {name} is {capability[0]}.{capability[1]}: use quantization 'none'"
        )


def scale_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``rows`` in FP8 and its float32 scale (``rows ~= fp8 * scale``), eagerly.

    The scale is rounded to the rows' dtype first, so that dividing by it stays in that dtype and
    the matmul multiplies back by the very same value.
    """
    scale = (rows.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX).to(rows.dtype)
    return (rows / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.float()


@functools.cache
def fused_scale_rows() -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``scale_rows`` as one or two fused kernels on GPUs: eagerly it is five passes over a linear's
    input, which cost more than FP8 saves in the matmul. Compiled once per process, for any row count.

    Built on first use: ``torch.compile`` imports inductor (0.9 s of every rank's start on CPU),
    which a group without FP8 never runs.
    """
    return torch.compile(scale_rows, dynamic=True)


class Fp8Linear(nn.Linear):
    """A linear layer whose weight becomes FP8 with one scale per output row at ``quantize_``.

    Until then it holds the weight as the checkpoint does (the loader fills it) and runs no forward.
    ``quantize_`` picks how its forwards scale their inputs (``scale_rows``): fused on CUDA.
    """

    weight_scale: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.register_buffer("weight_scale", None, persistent=False)
        self.scale_rows = scale_rows

    @classmethod
    def like(cls, linear: nn.Linear) -> Fp8Linear:
        """An ``Fp8Linear`` that holds ``linear``'s own parameters (meta ones before the load)."""
        new = cls(linear.in_features, linear.out_features, bias=False, device="meta", dtype=linear.weight.dtype)
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def expect_stored_(self) -> None:
        """Makes this linear take its FP8 weight and its scales as a checkpoint stores them (an FP8
        folder: ``ray_hsdp.loading.fp8_folder``): the (meta) weight becomes FP8 with the same sharding, and
        ``weight_scale`` a persistent buffer of every row's scale that the loader fills whole. Call
        after sharding (whose split of a unit follows the dtypes it finds) and before the model is
        materialised."""
        weight = self.weight
        if isinstance(weight, DTensor):
            local = torch.empty_like(weight.to_local(), dtype=FP8)
            weight = DTensor.from_local(
                local, weight.device_mesh, weight.placements, run_check=False, shape=weight.shape,
                stride=weight.stride(),
            )  # fmt: skip
        else:
            weight = torch.empty_like(weight, dtype=FP8)
        self.weight = nn.Parameter(weight, requires_grad=False)
        scale = torch.empty(1, self.out_features, dtype=torch.float32, device=self.weight.device)
        self.register_buffer("weight_scale", scale, persistent=True)

    @torch.no_grad()
    def quantize_(self) -> None:
        """Replaces this rank's rows of the weight (a DTensor sharded on dim 0, or a whole tensor)
        by their FP8 values and keeps the scales of every row (gathered once from the other ranks);
        a weight loaded in FP8 (``expect_stored_``) stays as it is."""
        weight = self.weight
        local = weight.to_local() if isinstance(weight, DTensor) else weight.detach()
        self.scale_rows = fused_scale_rows() if local.is_cuda else scale_rows
        if local.dtype == FP8:  # loaded as an FP8 folder stores it, with its scales
            return
        # Times the reciprocal, not divided by FP8_MAX: CUDA divides a tensor by a scalar that way, the
        # CPU truly divides, and a folder quantized on one must equal quantizing on the other.
        scale = local.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) * (1.0 / FP8_MAX)
        quantized = (local.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        if isinstance(weight, DTensor):
            mesh = weight.device_mesh
            world = mesh.size()
            rows = rows_per_rank(weight.shape[0], world)
            padded = torch.ones(rows, 1, dtype=torch.float32, device=scale.device)
            padded[: scale.shape[0]] = scale
            everyone = torch.empty(rows * world, 1, dtype=torch.float32, device=scale.device)
            dist.all_gather_into_tensor(everyone, padded, group=mesh.get_group())
            full_scale = everyone[: weight.shape[0]]
            quantized = DTensor.from_local(
                quantized, mesh, [Shard(0)], run_check=False, shape=weight.shape, stride=weight.stride()
            )
        else:
            full_scale = scale
        self.weight = nn.Parameter(quantized, requires_grad=False)
        # (1, out): _scaled_mm's row-wise scale of its second matrix, the weight's transpose.
        self.weight_scale = full_scale.reshape(1, -1).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        quantized, scale = self.scale_rows(x.reshape(-1, x.shape[-1]))
        out = torch._scaled_mm(
            quantized,
            self.weight.t(),
            scale_a=scale,
            scale_b=self.weight_scale,
            out_dtype=x.dtype,
            use_fast_accum=True,
        )
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def fp8_candidates(plan: ShardPlan) -> list[tuple[nn.Module, str, nn.Linear]]:
    """``(parent, name, linear)`` of every ``nn.Linear`` inside the plan's units (not in its
    replicated submodules) whose sides are multiples of 16: the linears FP8 keeps in FP8."""
    replicated = {id(m) for _, module in plan.replicated for m in module.modules()}
    found = []
    for _, unit in plan.units:
        for parent in list(unit.modules()):
            if id(parent) in replicated:
                continue
            for name, child in list(parent.named_children()):
                if type(child) is not nn.Linear or id(child) in replicated:
                    continue
                if child.in_features % _ALIGN or child.out_features % _ALIGN:
                    continue
                found.append((parent, name, child))
    return found


def fp8_linears(plan: ShardPlan) -> int:
    """Swaps every linear of ``fp8_candidates`` for an ``Fp8Linear`` holding its parameters; call
    before sharding.

    Returns:
        How many linears were swapped.
    """
    candidates = fp8_candidates(plan)
    for parent, name, child in candidates:
        setattr(parent, name, Fp8Linear.like(child))
    return len(candidates)


def expect_stored_fp8(root: nn.Module) -> list[str]:
    """Makes every ``Fp8Linear`` of ``root`` take its weight and scales in FP8 from the checkpoint
    (``Fp8Linear.expect_stored_``).

    Returns:
        Their names in ``root``: what the folder must store.
    """
    names = [name for name, m in root.named_modules() if isinstance(m, Fp8Linear)]
    for name in names:
        root.get_submodule(name).expect_stored_()
    return names


def quantize_fp8(root: nn.Module, compile_scaling: bool = True) -> int:
    """Quantizes every loaded ``Fp8Linear`` of ``root`` (each rank its own rows; those loaded in
    FP8 stay as they are); call after the load and before the in-place gathers are activated. With
    ``compile_scaling``, then ``compile_fp8_scaling``.

    Returns:
        How many linears were quantized.
    """
    linears = [m for m in root.modules() if isinstance(m, Fp8Linear)]
    for linear in linears:
        linear.quantize_()
    if compile_scaling:
        compile_fp8_scaling(root)
    return len(linears)


def compile_fp8_scaling(root: nn.Module) -> None:
    """On GPUs, compiles the activations' scaling of ``root``'s quantized linears now, at the
    group's start, rather than in the first request's forward, where the other ranks of the group
    would wait on it (one compile serves every row count and width)."""
    first = next((m for m in root.modules() if isinstance(m, Fp8Linear)), None)
    if first is None or first.scale_rows is scale_rows:  # none, or the eager one (CPU)
        return
    # The activations' dtype: the model's (a weight loaded in FP8 no longer says it).
    dtype = next(p.dtype for p in root.parameters() if p.dtype.is_floating_point and p.element_size() > 1)
    first.scale_rows(torch.zeros(16, first.in_features, dtype=dtype, device=first.weight_scale.device))
