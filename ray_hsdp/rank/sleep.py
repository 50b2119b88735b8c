"""A rank's sleep: where its weights rest while the model sleeps (``ray_hsdp.pipeline.residence``),
built at its first sleep or host check, and what the rank's sleep calls do with it. Modules that
import torch are imported inside the methods (see ``ray_hsdp.rank.actor``)."""

from __future__ import annotations

import time

from ray_hsdp.config.group import GroupConfig
from ray_hsdp.rank.start import LoadedRank

#: How long a sleep waits for a rank's session to end (its last request just answered).
SLEEP_IDLE_WAIT_S = 10.0


class RankSleep:
    """The sleep of one rank: its weights' ``Residence``, built once from its loaded pipeline.

    Args:
        rank: Index in the group.
        config: The group's configuration (``sleep_level``, ``sleep_folder``, ``device``).
        spill_name: The name of the rank's spill file at level 2 (group and rank).
    """

    def __init__(self, rank: int, config: GroupConfig, spill_name: str):
        self.rank = rank
        self.config = config
        self.spill_name = spill_name
        self.residence = None  # where the weights rest while the model sleeps (built at the first sleep)

    def parked(self, loaded: LoadedRank | None):
        """The rank's ``Residence``, built at the first call."""
        if self.residence is None:
            from ray_hsdp.pipeline.residence import pipeline_residence
            from ray_hsdp.pipeline.spill_file import SpillFile

            if loaded is None:
                raise RuntimeError(f"rank {self.rank} has no pipeline loaded")
            spill = None
            if self.config.sleep_level == 2:
                spill = SpillFile(self.config.sleep_folder, self.spill_name, self.config.device)
            self.residence = pipeline_residence(loaded.pipeline, pin=self.config.device == "cuda", spill=spill)
        return self.residence

    def host_need(self, loaded: LoadedRank | None) -> dict:
        """What the sleep needs of its node: host memory (0 once reserved; level 2: its staging
        buffers) and, at level 2, disk under ``sleep_dir``; with what the node has."""
        from ray_hsdp import distributed
        from ray_hsdp.memory import available_host_bytes
        from ray_hsdp.pipeline.spill_file import SpillFile

        residence = self.parked(loaded)
        need = {
            "rank": self.rank,
            "node": distributed.node_ip(),
            "bytes": residence.host_bytes if residence.spill is not None or not residence.allocated else 0,
            "available": available_host_bytes(),
        }
        if residence.spill is not None:
            folder = self.config.sleep_folder
            disk = 0 if residence.allocated else residence.nbytes
            need.update(disk_bytes=disk, disk_free=SpillFile.free_bytes(folder), folder=folder)
        return need

    def sleep(self, loaded: LoadedRank | None) -> dict:
        """Parks the weights once the rank holds no request, waiting ``SLEEP_IDLE_WAIT_S`` for a
        session whose last request is ending; ``busy`` if it still held one then."""
        runtime = loaded.runtime if loaded is not None else None
        deadline = time.monotonic() + SLEEP_IDLE_WAIT_S
        while runtime is not None and (runtime.in_session or runtime.progress()):
            if time.monotonic() > deadline:
                return {"rank": self.rank, "busy": True}
            time.sleep(0.005)
        return {"rank": self.rank, **self.parked(loaded).sleep().as_dict()}

    def wake_if_built(self) -> None:
        """Wakes the weights if a sleep's residence exists (at once when awake: it looks under its
        lock, so a sleep under way ends first)."""
        if self.residence is not None:
            self.residence.wake()

    def report(self) -> dict:
        """The sleep's part of the memory report: the bytes it parks, whether asleep, and the
        pipeline's tensors on the device now (0 asleep); zeros before the first sleep."""
        residence = self.residence
        return {
            # Once the model slept: the bytes it parks, and those of them on the device now (0 asleep).
            "parked_bytes": residence.nbytes if residence is not None else 0,
            "asleep": residence is not None and residence.asleep,
            # The pipeline's tensors on the device now, collected afresh (0 asleep: none was missed).
            "resident_tensor_bytes": residence.resident_bytes if residence is not None else 0,
        }

    def remove_spill(self) -> None:
        """Removes the level-2 spill file, if any (the rank leaves)."""
        if self.residence is not None and self.residence.spill is not None:
            self.residence.spill.remove()
