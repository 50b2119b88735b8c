"""The video job store and its state machine (``ray_hsdp.serve.job_store``), against SQLite and
against a real PostgreSQL server that the tests start themselves (``tests/postgres.py``)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from postgres import postgres_server, server_binaries

from ray_hsdp.request import GenerationRequest, StepCache
from ray_hsdp.serve.job_records import decode_spec, encode_spec
from ray_hsdp.serve.job_store import TRANSITION_METHODS, TRANSITIONS, JobStore

LIMITS = {"max_jobs": 8, "max_bytes": 2**20, "ttl_s": 60, "stale_after_s": 60, "lost_wait_s": 60}


@pytest.fixture(scope="module")
def postgres():
    if server_binaries() is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl): install Debian's postgresql package")
    with postgres_server() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path):
    """A fresh, empty database of each kind: a SQLite file, or a new database on the server."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'jobs.sqlite'}"
        return
    from sqlalchemy import create_engine, text

    server = request.getfixturevalue("postgres")
    name = f"jobs_{uuid.uuid4().hex[:12]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {name}"))
    yield server.replace("/postgres?", f"/{name}?")
    admin.dispose()


def make(url: str, media, **limits) -> JobStore:
    store = JobStore(url, str(media))
    store.configure("app", {**LIMITS, **limits})
    return store


def test_a_record_and_its_mp4_outlive_the_store_that_wrote_them(store_url, tmp_path):
    """A restarted store (a new process on the same database and media) has every job, its state,
    its attempt and its MP4; the endpoint's limits too."""
    first = make(store_url, tmp_path / "media", max_jobs=3)
    _, done = first.create("app", "pool", {"model": "m", "prompt": "done"}, "a", "spec")
    _, running = first.create("app", "pool", {"model": "m", "prompt": "running"}, "a", "spec")
    assert first.report(running["id"], "a", 1, progress=40, running=True)
    assert first.complete(done["id"], "a", 1, b"mp4 bytes", b"png bytes", "64x48")
    first.engine.dispose()

    again = JobStore(store_url, str(tmp_path / "media"))
    assert again.get("app", done["id"])["size"] == "64x48"
    assert again.content("app", done["id"], "video") == ("ok", b"mp4 bytes")
    assert again.content("app", done["id"], "thumbnail") == ("ok", b"png bytes")
    kept = again.get("app", running["id"])
    assert (kept["status"], kept["progress"], kept["attempt"]) == ("in_progress", 40, 1)
    assert again.report(running["id"], "a", 1, progress=60)  # its owner goes on reporting
    assert again.limits_of("app")["max_jobs"] == 3
    assert again.create("app", "pool", {"model": "m"}, "a", "spec")[0] == "ok"
    assert again.create("app", "pool", {"model": "m"}, "a", "spec")[0] == "full"
    assert again.create("other", "pool", {"model": "m"}, "a", "spec")[0] == "ok"  # another endpoint: its own limits


def test_a_late_report_of_an_earlier_attempt_is_refused_and_a_moved_job_restarts_at_zero(store_url, tmp_path):
    store = make(store_url, tmp_path / "media")
    _, video = store.create("app", "pool", {"model": "wan", "prompt": "p"}, "a", "spec")
    assert video["attempt"] == 1 and store.report(video["id"], "a", 1, progress=70, running=True)
    assert store.release(video["id"], "a", 1, "group_failed", "rank 1 died")
    released = store.get("app", video["id"])
    assert (released["status"], released["progress"], released["attempt"]) == ("queued", 0, 1)
    assert store.release(video["id"], "a", 1, "group_failed", "again") is False  # owned by none now
    [(video_id, model, spec, last, attempt, code)] = store.claim(["pool"], hold_s=60)
    assert (video_id, model, spec, last, attempt, code) == (video["id"], "wan", "spec", "a", 1, "group_failed")
    assert store.adopt(video_id, "b", 1) == 2
    assert store.report(video_id, "a", 1, progress=80) is False  # a's copy stops
    assert store.complete(video_id, "a", 1, b"a's", b"png") is False
    assert store.fail(video_id, "group_failed", "a's copy failed", "a", 1) is False  # not the job's
    assert store.report(video_id, "b", 2, progress=30)
    moved = store.get("app", video_id)
    assert (moved["status"], moved["progress"], moved["attempt"], moved["retried"]) == ("in_progress", 30, 2, True)
    assert store.complete(video_id, "b", 2, b"b's", b"png")
    assert store.complete(video_id, "b", 2, b"b's", b"png")  # sent again (a restarted store): the same answer
    assert store.content("app", video_id, "video") == ("ok", b"b's")
    assert (store.get("app", video_id)["progress"], store.get("app", video_id)["replica"]) == (100, "b")


def test_one_attempt_is_adopted_once_whichever_replicas_race(store_url, tmp_path):
    """Sixteen threads over two store objects (two store processes on one database) adopt one
    released attempt: one wins; the claim is held against a second ingress meanwhile."""
    stores = [make(store_url, tmp_path / "media"), JobStore(store_url, str(tmp_path / "media"))]
    _, video = stores[0].create("app", "pool", {"model": "wan"}, "a", "spec")
    assert stores[0].release(video["id"], "a", 1, "drained", "removed")
    assert len(stores[0].claim(["pool"], hold_s=60)) == 1 and stores[1].claim(["pool"], hold_s=60) == []
    # A placement that failed frees the claim soon, for any ingress (not after the whole hold).
    assert stores[0].unclaim(video["id"], 1, retry_in_s=0.0)
    assert len(stores[1].claim(["pool"], hold_s=60)) == 1
    barrier, won = threading.Barrier(16), []

    def adopt(i: int) -> None:
        barrier.wait()
        if stores[i % 2].adopt(video["id"], f"replica-{i}", 1) is not None:
            won.append(i)

    threads = [threading.Thread(target=adopt, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(won) == 1, won
    assert stores[0].get("app", video["id"])["attempt"] == 2
    assert stores[1].adopt(video["id"], "late", 1) is None
    assert not stores[0].unclaim(video["id"], 1, retry_in_s=0.0)  # adopted: no claim of it to free


def test_a_released_job_no_group_takes_fails_and_stays_failed(store_url, tmp_path):
    store = make(store_url, tmp_path / "media", stale_after_s=0.3, lost_wait_s=0.3)
    _, video = store.create("app", "pool", {"model": "m", "prompt": "p"}, "a", "spec")
    assert store.report(video["id"], "a", 1, progress=30)
    deadline = time.time() + 30
    while store.get("app", video["id"])["progress"] != 0:  # a stopped reporting: released
        assert time.time() < deadline
        time.sleep(0.1)
    assert store.claim(["pool"], hold_s=60)[0][0] == video["id"]
    while store.get("app", video["id"])["status"] != "failed":  # no group adopted it in lost_wait_s
        assert time.time() < deadline
        time.sleep(0.1)
    failed = store.get("app", video["id"])
    assert failed["error"]["code"] == "replica_lost", failed
    assert "no other group took it over within video_lost_wait_s" in failed["error"]["message"]
    assert store.report(video["id"], "a", 1, progress=60) is False
    assert store.complete(video["id"], "a", 1, b"mp4", b"png") is False
    assert store.adopt(video["id"], "b", 1) is None
    assert store.content("app", video["id"], "video") == ("not_ready", "failed")
    assert store.fail(video["id"], "other", "later") is False  # terminal: the first reason stays


def test_a_create_sent_again_with_its_id_is_the_same_job_as_its_next_attempt(store_url, tmp_path):
    store = make(store_url, tmp_path / "media")
    assert store.create("app", "pool", {"prompt": "p"}, "a", "spec", "video_x")[0] == "ok"
    status, again = store.create("app", "pool", {"prompt": "p"}, "b", "spec", "video_x")
    assert (status, again["id"], again["attempt"]) == ("ok", "video_x", 2)
    assert store.counts("app") == {"queued": 1}
    assert store.report("video_x", "a", 1) is False and store.complete("video_x", "b", 2, b"mp4", b"png")
    assert store.create("app", "pool", {"prompt": "p"}, "c", "spec", "video_x")[0] == "ended"
    assert store.get("other", "video_x") is None  # another endpoint's id


def test_a_job_waiting_on_a_busy_group_moves_once_to_a_group_with_a_free_lane(store_url, tmp_path):
    store = make(store_url, tmp_path / "media")
    _, running = store.create("app", "pool", {"model": "m", "prompt": "running"}, "a", "spec running")
    _, waiting = store.create("app", "pool", {"model": "m", "prompt": "waiting"}, "a", "spec waiting")
    _, own = store.create("app", "pool", {"model": "m", "prompt": "own"}, "b", "spec own")
    assert store.report(running["id"], "a", 1, running=True)
    assert store.take_waiting("b", "pool", waited_s=60) is None  # nothing waited a minute
    time.sleep(0.05)
    assert store.take_waiting("b", "pool", waited_s=0.01) == (waiting["id"], "spec waiting", 2)
    assert store.report(waiting["id"], "a", 1) is False  # the first replica stops its copy
    assert store.report(waiting["id"], "b", 2, running=True)  # b runs it: no longer waiting
    assert store.take_waiting("b", "pool", waited_s=0.01) is None  # the running job and b's own stay
    assert store.take_waiting("c", "other pool", waited_s=0.01) is None
    assert store.take_waiting("c", "pool", waited_s=0.01) == (own["id"], "spec own", 2)
    # Moved while queued, never run: no retry, as a job released before it ran.
    assert store.get("app", waiting["id"])["retried"] is False
    assert store.release(own["id"], "c", 2, "group_failed", "before it ran")
    assert store.get("app", own["id"])["retried"] is False


def test_expired_jobs_go_with_their_files_and_deleted_ones_at_once(store_url, tmp_path):
    store = make(store_url, tmp_path / "media", ttl_s=0.3)
    _, video = store.create("app", "pool", {"model": "m"}, "a", "spec")
    _, deleted = store.create("app", "pool", {"model": "m"}, "a", "spec")
    assert store.complete(video["id"], "a", 1, b"mp4", b"png") and store.complete(deleted["id"], "a", 1, b"x", b"y")
    assert len(list((tmp_path / "media").iterdir())) == 4
    assert store.delete("app", deleted["id"]) and store.delete("app", deleted["id"]) is False
    assert store.report(deleted["id"], "a", 1) is False
    deadline = time.time() + 30
    while store.get("app", video["id"]) is not None:
        assert time.time() < deadline
        time.sleep(0.1)
    assert list((tmp_path / "media").iterdir()) == []
    assert store.list("app", 10, None, "desc")["data"] == []


def test_pages_list_newest_first_and_after_an_id(store_url, tmp_path):
    store = make(store_url, tmp_path / "media")
    ids = [store.create("app", "pool", {"model": "m", "prompt": str(i)}, "a", "spec")[1]["id"] for i in range(3)]
    page = store.list("app", 2, None, "desc")
    assert [v["id"] for v in page["data"]] == ids[:0:-1] and page["has_more"]
    rest = store.list("app", 2, page["last_id"], "desc")
    assert [v["id"] for v in rest["data"]] == ids[:1] and not rest["has_more"]
    assert [v["id"] for v in store.list("app", 5, ids[0], "asc")["data"]] == ids[1:]
    assert store.list("app", 5, "video_nope", "asc") is None


def test_the_store_names_each_transition_and_terminal_states_never_change(tmp_path):
    store = make(f"sqlite:///{tmp_path / 'jobs.sqlite'}", tmp_path / "media")
    # Each transition is a method of the store (the only writers of a job's row).
    assert all(callable(getattr(store, TRANSITION_METHODS.get(name, name), None)) for name in TRANSITIONS)
    _, video = store.create("app", "pool", {"prompt": "p"}, "a", "spec")
    assert store.report(video["id"], "a", 1, running=True) and store.get("app", video["id"])["status"] == "in_progress"
    assert store.complete(video["id"], "a", 1, b"mp4", b"png") and store.get("app", video["id"])["progress"] == 100
    assert store.fail(video["id"], "late", "too late") is False
    assert store.get("app", video["id"])["status"] == "completed"
    assert store.release(video["id"], "a", 1, "drained", "late") is False


def test_a_request_round_trips_through_its_stored_spec():
    job = GenerationRequest(
        prompt="a cat", width=64, height=32, num_frames=9, seed=7, image=b"\x89PNG...", lora=(("style", 0.5),),
        cache=StepCache(kind="taylorseer", interval=3), flow_shift=3.0, queue_deadline=12.5,
    )  # fmt: skip
    assert decode_spec(encode_spec(job, 16)) == (job, 16)
