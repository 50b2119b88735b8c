"""The video job store under load: many owners reporting, MP4s completing, a client reading.

    python -m bench.job_store --db sqlite --out bench/results
    python -m bench.job_store --db postgresql --out bench/results   # starts a PostgreSQL of its own

The store's actor alone (``ray_hsdp.serve.jobs.actor``) on a Ray of its own, as the cluster runs it.
``--owners`` owners (a replica each, spread over ``--hosts`` processes as replicas are) hold
``--jobs-per-owner`` active jobs each and report them ``--hz`` times a second (``renew``, the
replica's one call per round for all its jobs);
every second one owner's job completes with an MP4 of ``--mp4-mib`` (written to the media store by
the owner, then ``complete_stored``; ``--through-store``: its bytes sent to the store's actor, the
path a process that cannot reach the media takes) and the owner starts another job. Meanwhile a
client reads one job (``get``, what ``GET /v1/videos/{id}`` asks) ``--reads-hz`` times a second and
an ingress polls ``claim`` 4 times a second. Writes the read and report latencies (p50, p99, max),
the reports lost (an exception, or a job its owner holds refused) and the completions.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import environment, write_results

ENDPOINT, POOL = "bench", "bench#pool"


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"n": len(values), "p50_ms": 1e3 * statistics.median(values), "p99_ms": 1e3 * pick(0.99),
            "max_ms": 1e3 * ordered[-1]}  # fmt: skip


class OwnerHost:
    """One process of owners (as a group replica is one): each owner holds one job and reports it."""

    def __init__(self, owners: list[str], hz: float, mp4_bytes: int, through_store: bool, per_owner: int = 1):
        from ray_hsdp.serve.jobs.actor import find_store

        self.store = find_store()
        self.owners, self.period = owners, 1.0 / hz
        self.mp4 = b"\0" * mp4_bytes
        self.through_store = through_store
        self.per_owner = per_owner
        #: Owner -> the (video id, attempt) of each job it holds (its first one is the one completed).
        self.jobs: dict[str, list[tuple[str | None, int]]] = {owner: [] for owner in owners}
        self.latencies: list[float] = []
        self.lost = 0
        self.completed = 0

    async def _new_job(self, owner: str, slot: int | None = None) -> None:
        _, video = await self.store.create.remote(ENDPOINT, POOL, {"model": "m", "prompt": owner}, owner, "{}")
        if slot is None:
            self.jobs[owner].append((video["id"], video["attempt"]))
        else:
            self.jobs[owner][slot] = (video["id"], video["attempt"])

    async def run(self, seconds: float) -> dict:
        await asyncio.gather(*(self._new_job(owner) for owner in self.owners for _ in range(self.per_owner)))
        deadline = time.monotonic() + seconds
        await asyncio.gather(*(self._report(owner, deadline) for owner in self.owners))
        return {"latencies": self.latencies, "lost": self.lost}

    async def _report(self, owner: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            held = [job for job in self.jobs[owner] if job[0] is not None]  # (one completing is not reported)
            started = time.monotonic()
            try:
                reports = [dict(video_id=video_id, attempt=attempt, progress=50) for video_id, attempt in held]
                kept = await self.store.renew.remote(owner, reports)
                # (A report of the job that completed meanwhile is refused, rightly: not lost.)
                self.lost += sum(1 for job, ok in zip(held, kept) if not ok and job in self.jobs[owner])
            except Exception:  # noqa: BLE001 - counted: a report that did not land
                self.lost += 1
            self.latencies.append(time.monotonic() - started)
            await asyncio.sleep(max(0.0, self.period - (time.monotonic() - started)))

    async def complete_one(self) -> float:
        """Completes one owner's job with an MP4 and starts the next; returns its seconds."""
        from ray_hsdp.serve.jobs.media import JobMedia

        owner = self.owners[self.completed % len(self.owners)]
        video_id, attempt = self.jobs[owner][0]
        self.jobs[owner][0] = (None, 0)
        started = time.monotonic()
        if self.through_store:
            await self.store.complete.remote(video_id, owner, attempt, self.mp4, b"png")
        else:
            url, node = await self.store.media_location.remote()
            key = f"{video_id}-{attempt}"
            stored = await asyncio.to_thread(JobMedia(url, node).write, key, self.mp4, b"png")
            await self.store.complete_stored.remote(video_id, owner, attempt, key, stored)
        seconds = time.monotonic() - started
        self.completed += 1
        await self._new_job(owner, slot=0)
        return seconds


async def reader(store, video_id: str, hz: float, deadline: float) -> list[float]:
    latencies = []
    while time.monotonic() < deadline:
        started = time.monotonic()
        await store.get.remote(ENDPOINT, video_id)
        latencies.append(time.monotonic() - started)
        await asyncio.sleep(max(0.0, 1.0 / hz - latencies[-1]))
    return latencies


async def claimer(store, deadline: float) -> None:
    while time.monotonic() < deadline:
        await store.claim.remote([POOL], 30.0)
        await asyncio.sleep(0.25)


async def load(args, store) -> dict:
    import ray

    host = ray.remote(num_cpus=0)(OwnerHost)
    per = args.owners // args.hosts
    mp4 = args.mp4_mib * 2**20
    hosts = [
        host.remote([f"owner-{h}-{i}" for i in range(per)], args.hz, mp4, args.through_store, args.jobs_per_owner)
        for h in range(args.hosts)
    ]
    runs = [h.run.remote(args.seconds) for h in hosts]
    while sum((await store.counts.remote(ENDPOINT)).values()) < per * args.hosts * args.jobs_per_owner:
        await asyncio.sleep(0.5)  # every host's jobs created
    listed = await store.list.remote(ENDPOINT, 1, None, "desc")
    deadline = time.monotonic() + args.seconds - 2.0
    reads = asyncio.ensure_future(reader(store, listed["data"][0]["id"], args.reads_hz, deadline))
    claims = asyncio.ensure_future(claimer(store, deadline))
    completions = []
    while time.monotonic() < deadline - 1.0:
        tick = time.monotonic()
        completions.append(await hosts[len(completions) % len(hosts)].complete_one.remote())
        await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
    owned = await asyncio.gather(*runs)
    await claims
    return {
        "read": percentiles(await reads),
        "report": percentiles([x for o in owned for x in o["latencies"]]),
        "reports_lost": sum(o["lost"] for o in owned),
        "completions": percentiles(completions),
        "completed": (await store.counts.remote(ENDPOINT)).get("completed", 0),  # what the store holds
        "statuses": await store.counts.remote(ENDPOINT),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--owners", type=int, default=200)
    parser.add_argument("--hosts", type=int, default=4, help="processes the owners are spread over")
    parser.add_argument("--jobs-per-owner", type=int, default=1, help="jobs each owner holds (one report each round)")
    parser.add_argument("--hz", type=float, default=4.0)
    parser.add_argument("--mp4-mib", type=int, default=40)
    parser.add_argument("--through-store", action="store_true", help="MP4 bytes sent to the store's actor")
    parser.add_argument("--reads-hz", type=float, default=20.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    import contextlib

    import ray

    from ray_hsdp.serve.jobs.actor import open_store

    with contextlib.ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_jobs_")))
        if args.db == "postgresql":
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from postgres import postgres  # the tests' throwaway server (Debian's postgresql package)

            url = stack.enter_context(postgres()).url
        else:
            url = f"sqlite:///{folder / 'jobs.sqlite'}"
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)  # a Ray of its own
        stack.callback(ray.shutdown)
        store = open_store(url, str(folder / "media"))
        ray.get(store.configure.remote(ENDPOINT, {"max_jobs": 100000, "max_bytes": 2**50}))
        result = asyncio.run(load(args, store))
    payload = {"environment": environment(), "args": {k: v for k, v in vars(args).items() if k != "out"}, **result}
    print(payload)
    if args.out is not None:
        path = "through-store" if args.through_store else "direct"
        name = f"job-store-{args.db}-{args.owners}x{args.jobs_per_owner}-{path}"
        r, p = result["read"], result["report"]
        markdown = (
            f"# Job store under load ({args.db}, {args.owners} owners of {args.jobs_per_owner} jobs reporting at "
            f"{args.hz:g} Hz, {args.mp4_mib} MiB MP4 "
            f"each second, {path})\n\n`{payload['environment']['command']}` on {payload['environment']['host']}\n\n"
            "| read p50 | read p99 | read max | report p50 | report p99 | reports lost | MP4s completed |\n"
            "| --- | --- | --- | --- | --- | --- | --- |\n"
            f"| {r['p50_ms']:.1f} ms | {r['p99_ms']:.1f} ms | {r['max_ms']:.1f} ms | {p['p50_ms']:.1f} ms | "
            f"{p['p99_ms']:.1f} ms | {result['reports_lost']} | {result['completed']} |\n"
        )
        write_results(args.out, name, payload, markdown)
    return payload


if __name__ == "__main__":
    main()
