"""``ray-hsdp check`` on GPU shares: for the models of each ``gpu_share`` in a file, what each holds
per GPU awake, which of them fit awake together (within ``gpu_share_budget_gib``, and within
``--gpu-memory``), and the host memory their weights take while they sleep."""

from __future__ import annotations

from dataclasses import dataclass

_GIB = 1024**3


@dataclass
class ShareMember:
    """One model of a share, as ``check`` read it."""

    model: str
    share: str
    per_gpu: int  # bytes of its weights on each GPU (from the folder's headers)
    gpus: int  # its shard_size: the share's GPUs
    budget_gib: float | None
    resident: bool
    sleep_level: int = 1  # 2: its weights sleep in files on disk, not in pinned host memory


def awake_together(members: list[ShareMember], budget: int | None) -> int:
    """The most members awake at once: one without a budget; else as many of the smallest as fit
    beside the resident ones (which are always awake)."""
    if budget is None:
        return 1
    resident = [m for m in members if m.resident]
    room = budget - sum(m.per_gpu for m in resident)
    count = len(resident)
    for member in sorted((m for m in members if not m.resident), key=lambda m: m.per_gpu):
        if member.per_gpu > room:
            break
        room -= member.per_gpu
        count += 1
    return count


def share_lines(members: list[ShareMember], gpu_memory_gib: float | None) -> tuple[list[str], list[str]]:
    """Per share: ``(lines, failures)`` that ``check`` prints after the applications' reports."""
    lines: list[str] = []
    failures: list[str] = []
    for share in sorted({m.share for m in members}):
        mine = [m for m in members if m.share == share]
        budgets = {m.budget_gib for m in mine}
        gpus = {m.gpus for m in mine}
        if len(budgets) > 1 or len(gpus) > 1:
            failures.append(
                f"gpu_share {share!r}: its models give different shard_size ({sorted(gpus)}) or gpu_share_budget_gib "
                f"({sorted(budgets, key=str)}): every model of a share gives the same"
            )
            continue
        budget_gib = budgets.pop()
        budget = int(budget_gib * _GIB) if budget_gib is not None else None
        shard = gpus.pop()
        lines.append(f"gpu_share {share}: {len(mine)} model(s) on {shard} GPU(s) of one node")
        for m in mine:
            lines.append(f"  {m.model}: {m.per_gpu / _GIB:.2f} GiB per GPU awake{' (resident)' if m.resident else ''}")
        for m in mine:
            if budget is not None and m.per_gpu > budget:
                failures.append(f"gpu_share {share!r}: {m.model} alone ({m.per_gpu / _GIB:.2f} GiB per GPU) exceeds "
                                f"gpu_share_budget_gib {budget_gib:g}")  # fmt: skip
        together = awake_together(mine, budget)
        limit = f"gpu_share_budget_gib {budget_gib:g}" if budget is not None else "no budget: one at a time"
        lines.append(f"  awake together: at most {together} of {len(mine)} ({limit})")
        if gpu_memory_gib is not None and budget is not None and budget > gpu_memory_gib * _GIB:
            failures.append(f"gpu_share {share!r}: gpu_share_budget_gib {budget_gib:g} exceeds --gpu-memory "
                            f"{gpu_memory_gib:g} GiB")  # fmt: skip
        # Level 1: every model's ranks pin their weights' host buffers at the model's start; level 2:
        # each rank writes a file of them in sleep_dir.
        host = sum(m.per_gpu for m in mine if m.sleep_level == 1) * shard
        disk = sum(m.per_gpu for m in mine if m.sleep_level == 2) * shard
        lines.append(
            f"  host memory for their weights asleep: {host / _GIB:.2f} GiB on the share's node "
            f"(pinned at each model's start; a model whose node lacks it refuses to start)"
        )
        if disk:
            lines.append(
                f"  disk for the weights of sleep_level 2 models: {disk / _GIB:.2f} GiB in their sleep_dir "
                "(written at each model's start; a node whose sleep_dir lacks it refuses to start)"
            )
    return lines, failures
