"""The owners' leases (``ray_hsdp.serve.jobs.leases``): a job leaves its owner when the owner's actor
is dead, within seconds, long before ``stale_after_s``; never while the actor lives."""

from __future__ import annotations

import time

import ray

from ray_hsdp.serve.jobs.store import JobStore


@ray.remote(num_cpus=0)
class Owner:
    def ping(self) -> bool:
        return True


def test_a_dead_owners_jobs_are_released_at_once_and_a_living_ones_stay(ray_cluster, tmp_path):
    store = JobStore(f"sqlite:///{tmp_path / 'jobs.sqlite'}", str(tmp_path / "media"))
    store.configure("app", {"stale_after_s": 600, "lost_wait_s": 600})
    dead, alive = Owner.remote(), Owner.remote()
    ray.get([dead.ping.remote(), alive.ping.remote()])
    _, lost = store.create("app", "pool", {"model": "m"}, "dead", "spec")
    _, kept = store.create("app", "pool", {"model": "m"}, "alive", "spec")
    assert store.renew("dead", [dict(video_id=lost["id"], attempt=1, running=True)], dead) == [True]
    assert store.renew("alive", [dict(video_id=kept["id"], attempt=1, running=True)], alive) == [True]
    ray.kill(dead)
    killed_at = time.monotonic()
    released = []
    while not released:  # the store pings a silent owner after PING_AFTER_S; a dead one answers at once
        assert time.monotonic() - killed_at < 30, "a dead owner's job was not released"
        released = store.claim(["pool"], hold_s=60)
        time.sleep(0.2)
    assert [(row[0], row[5]) for row in released] == [(lost["id"], "replica_lost")]
    row = store.get("app", kept["id"])
    assert (row["status"], row["attempt"]) == ("in_progress", 1)  # silent as long, but alive
    assert store.renew("alive", [dict(video_id=kept["id"], attempt=1)], alive) == [True]
