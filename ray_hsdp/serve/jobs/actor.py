"""The cluster's video job store as a Ray actor that no deployment owns, and its callers' client.

A detached actor on the head node (beside Serve's controller: a cluster that loses its head loses
Serve anyway), named, so that every ingress and group replica of every application reaches the
same one, and no ``serve deploy``, ``serve delete`` or replica restart takes it. Ray restarts it
if its process dies; it then reopens its database, where every record already is. One that was
killed for good is started again by the next ingress that needs it (``StoreClient``), with the
same ``job_store`` and ``media_store``: a lasting store loses nothing.

It runs its calls on a few threads: a read never waits behind another caller's write (the
transitions are compare-and-set in the database; the leases take their own lock).
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import ray

from ray_hsdp.serve.credentials import redact_url, with_password
from ray_hsdp.serve.jobs.store import JobStore

#: The store actor's name and Ray namespace.
STORE_NAME = "video_jobs"
STORE_NAMESPACE = "ray_hsdp"
#: The threads the store actor runs its calls on: a slow call (a database that does not answer) holds
#: one; more threads only contend for the GIL (bench.job_store: read p99 grew with 4 and 8).
STORE_THREADS = 2
#: The reads a client waits on (``GET /v1/videos/{id}``, a listing, a download's record, the metrics'
#: counts) run on a thread of their own (Ray's concurrency group ``reads``): never queued behind the
#: replicas' reports, hundreds a second under load.
READS = ("get", "list", "locate", "counts")
#: The calls of ``JobStore`` that its actor takes (each one of its methods: ``StoreClient.call``).
STORE_CALLS = (
    "media_location", "configure", "limits_of", "create", "renew", "report", "release", "claim", "unclaim", "adopt",
    "take_waiting", "complete", "complete_stored", "fail", "delete", "get", "list", "locate", "content", "counts",
)  # fmt: skip


def default_folder() -> Path:
    """Where the embedded store keeps its SQLite file and MP4s: under the Ray session's folder on
    the head node (it outlives every deployment, not the Ray cluster); outside Ray, under the
    user's data directory."""
    try:
        node = ray._private.worker.global_worker.node  # Ray has no public reader of the session folder
        return Path(node.get_session_dir_path()) / "ray_hsdp" / "video_jobs"
    except Exception:  # noqa: BLE001 - not in a Ray worker
        data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
        return Path(data) / "ray_hsdp" / "video_jobs"


class StoreActor:
    """The store's Ray actor: a ``JobStore`` with the embedded defaults resolved where it runs (the
    head node), whose calls (``STORE_CALLS``) it runs as its own methods.

    Args:
        job_store: The records' SQLAlchemy URL; ``None``: SQLite in ``default_folder()``.
        media_store: The MP4s' folder or fsspec URL; ``None``: ``default_folder()/media``.
        password_file, password_env: Where the database's password is on this node (the
            endpoint's ``job_store_password_file`` / ``_env``): read here, at each (re)start, so
            no argument the actor was created with carries it.
    """

    def __init__(
        self,
        job_store: str | None,
        media_store: str | None,
        password_file: str | None = None,
        password_env: str | None = None,
    ):
        self._configured = (job_store, media_store)
        folder = default_folder()
        if job_store is None or media_store is None:
            folder.mkdir(parents=True, exist_ok=True)
        url = with_password(job_store, password_file, password_env) if job_store else None
        node = ray.get_runtime_context().get_node_id()  # where a media folder is (``JobMedia.reaches``)
        self.store = JobStore(
            url or f"sqlite:///{folder / 'jobs.sqlite'}", media_store or str(folder / "media"), node=node
        )

    @property
    def engine(self):
        """The store's database engine (``JobStore.engine``)."""
        return self.store.engine

    def configured(self) -> tuple[str | None, str | None]:
        """The ``job_store`` and ``media_store`` it was started with (``None``: the default)."""
        return self._configured


def _store_call(name: str):
    """``JobStore``'s method ``name`` as a method of the actor that runs it on the actor's store, with
    its name, signature and docstring (Ray checks a call's arguments against the signature); a read
    (``READS``) on the ``reads`` thread."""
    method = getattr(JobStore, name)

    @functools.wraps(method)
    def store_call(self, *args, **kwargs):
        return getattr(self.store, name)(*args, **kwargs)

    return ray.method(concurrency_group="reads")(store_call) if name in READS else store_call


for _name in STORE_CALLS:
    setattr(StoreActor, _name, _store_call(_name))


def open_store(
    job_store: str | None,
    media_store: str | None,
    timeout_s: float = 60.0,
    password_file: str | None = None,
    password_env: str | None = None,
):
    """The cluster's store actor, started with these locations (and where its database's password
    is, ``StoreActor``) if none runs yet.

    Raises:
        ValueError: A store runs with other locations (one cluster, one store: say the same
            ``job_store`` and ``media_store`` in every endpoint of the cluster); the locations
            shown with their secrets redacted.
    """
    actor = (
        ray.remote(concurrency_groups={"reads": 1})(StoreActor)
        .options(
            name=STORE_NAME,
            namespace=STORE_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            resources={"node:__internal_head__": 0.001},
            max_restarts=-1,
            # A call in flight when its process died runs again on the restarted store: the
            # transitions are guarded by owner and attempt, and a repeated complete answers as the first.
            max_task_retries=-1,
            max_concurrency=STORE_THREADS,
        )
        .remote(job_store, media_store, password_file, password_env)
    )
    running = ray.get(actor.configured.remote(), timeout=timeout_s)
    if tuple(running) != (job_store, media_store):
        raise ValueError(
            f"this cluster's video job store runs with job_store={redact_url(running[0])!r}, "
            f"media_store={redact_url(running[1])!r}; this endpoint asks for job_store={redact_url(job_store)!r}, "
            f"media_store={redact_url(media_store)!r}: give every endpoint "
            "of the cluster the same two fields (or stop the store: ray.kill of the actor "
            f"{STORE_NAME!r} in namespace {STORE_NAMESPACE!r})"
        )
    return actor


def find_store(timeout_s: float = 60.0):
    """The cluster's store actor, once an ingress has started it.

    Raises:
        TimeoutError: None runs after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get_actor(STORE_NAME, namespace=STORE_NAMESPACE)
        except ValueError:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no video job store ({STORE_NAME!r} in namespace {STORE_NAMESPACE!r}) after {timeout_s:g}s: "
                    "an endpoint's ingress starts it"
                ) from None
            time.sleep(0.5)
