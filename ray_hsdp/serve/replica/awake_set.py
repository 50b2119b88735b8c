"""Who is awake on a GPU share: the models whose groups take turns on the same GPUs, what each
holds per GPU awake, and which to put to sleep so that another wakes (least recently used first,
never one with work in flight, never a ``resident`` one). Plain Python, decided at once: the share's
actor (``gpu_share``) runs the sleeps and wakes it picks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

#: A model's states on its share, as ``/v1/models`` and ``/health?model=`` say them: waiting for room
#: to load, loading, ready, going to sleep (``parking``: still holding its memory), asleep, waking, failed.
JOINING, STARTING, READY, PARKING, SLEEPING, WAKING, FAILED = (
    "joining",
    "loading",
    "ready",
    "parking",
    "sleeping",
    "waking",
    "failed",
)


@dataclass
class Member:
    """One model of the share.

    Attributes:
        bytes: What its group holds on each GPU awake (its ranks' parked bytes, the most of them);
            0 until its group loaded.
        resident: Never put to sleep.
        leases: The requests it runs or is about to run: it is not put to sleep while it has one.
        last_used: When a request last entered (``time.monotonic``): the least recent sleeps first.
    """

    model: str  # the served model's name (a key names one of its groups: ``model/group``)
    resident: bool = False
    bytes: int = 0
    state: str = STARTING
    leases: set[str] = field(default_factory=set)
    last_used: float = 0.0
    wakes: int = 0
    wake_seconds: float = 0.0


class AwakeSet:
    """The members of one share and its budget.

    Args:
        budget_bytes: The most bytes per GPU its awake members may hold together; ``None``: one
            member awake at a time (a resident member then keeps every other asleep, so a
            resident member needs a budget).
    """

    def __init__(self, budget_bytes: int | None):
        self.budget_bytes = budget_bytes
        self.members: dict[str, Member] = {}

    def join(self, key: str, model: str, resident: bool) -> Member:
        """Adds the group ``key`` of ``model`` (a rebuilt or replacing group has a key of its own;
        an older one of the model stays, and counts, until it is forgotten). Raises ``ValueError``
        for a resident model without a budget."""
        if resident and self.budget_bytes is None:
            raise ValueError(
                f"{model}: resident: true needs gpu_share_budget_gib (without a budget one model is awake at a "
                "time, and a resident one would keep every other asleep)"
            )
        member = Member(model, resident, state=JOINING)
        self.members[key] = member
        return member

    def awake(self) -> list[Member]:
        """Members that hold their weights on the GPUs now (loading, ready, going to sleep, waking)."""
        return [m for m in self.members.values() if m.state in (STARTING, READY, PARKING, WAKING)]

    def fits(self, member: Member) -> bool:
        """Whether ``member`` may be awake beside the others awake now."""
        others = [m for m in self.awake() if m is not member]
        if self.budget_bytes is None:
            return not others
        if member.bytes == 0 or any(m.bytes == 0 for m in others):
            # A size not yet known (a group loading) leaves room beside it for the resident models alone.
            return all(m.resident and m.bytes > 0 for m in others)
        return sum(m.bytes for m in others) + member.bytes <= self.budget_bytes

    def victims(self, key: str) -> list[Member] | None:
        """The members to put to sleep so that group ``key`` fits awake, least recently used first;
        ``[]``: it fits now; ``None``: not until a member's work ends (or it never fits alone:
        ``too_large`` says so)."""
        member = self.members[key]
        if self.fits(member):
            return []
        idle = sorted(
            (
                m
                for m in self.members.values()
                if m.state == READY and not m.leases and not m.resident and m is not member
            ),
            key=lambda m: m.last_used,
        )
        chosen: list[Member] = []
        try:
            for victim in idle:
                chosen.append(victim)
                victim.state = SLEEPING  # tentatively, to ask ``fits``
                if self.fits(member):
                    return chosen
            return None
        finally:
            for victim in chosen:
                victim.state = READY

    def too_large(self, key: str) -> str | None:
        """Why group ``key`` can never be awake here (its bytes alone, or with the resident members,
        exceed the budget), or ``None``."""
        member = self.members[key]
        if self.budget_bytes is None or member.bytes == 0:
            return None
        resident = sum(m.bytes for m in self.members.values() if m.resident and m is not member)
        if member.bytes + resident > self.budget_bytes:
            return (
                f"{member.model} holds {member.bytes / 2**30:.2f} GiB per GPU awake"
                + (f" beside {resident / 2**30:.2f} GiB of resident models" if resident else "")
                + f": more than gpu_share_budget_gib ({self.budget_bytes / 2**30:.2f} GiB)"
            )
        return None

    def enter(self, key: str, lease: str) -> None:
        """A request holds group ``key`` awake from now on."""
        member = self.members[key]
        member.leases.add(lease)
        member.last_used = time.monotonic()
