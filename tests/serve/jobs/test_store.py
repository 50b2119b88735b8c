"""The video job store and its state machine (``ray_hsdp.serve.jobs.store``), against SQLite and
against a real PostgreSQL server that the tests start themselves (``tests/postgres.py``)."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid

import pytest
from postgres import postgres as postgres_running
from postgres import postgres_server, server_binaries

from ray_hsdp.request import GenerationRequest, StepCache
from ray_hsdp.serve.jobs.leases import JobLeases
from ray_hsdp.serve.jobs.records import StoreUnavailableError, decode_spec, encode_spec
from ray_hsdp.serve.jobs.store import TRANSITION_METHODS, TRANSITIONS, JobStore

LIMITS = {"max_jobs": 8, "max_bytes": 2**20, "ttl_s": 60, "stale_after_s": 60, "lost_wait_s": 60, "max_attempts": 3}


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
    # The same release again (Ray runs a call again on a restarted store): the same answer; another
    # replica's release of that attempt is refused.
    assert store.release(video["id"], "a", 1, "group_failed", "again") is True
    assert store.release(video["id"], "b", 1, "group_failed", "not b's") is False
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


def swept_get(store, video_id: str) -> dict | None:
    """``get`` after the ingress' poll for released jobs (``claim``), which sweeps: a read does not."""
    store.claim(["no such pool"], hold_s=1)
    return store.get("app", video_id)


def test_a_released_job_no_group_takes_fails_and_stays_failed(store_url, tmp_path):
    store = make(store_url, tmp_path / "media", stale_after_s=0.3, lost_wait_s=0.3)
    _, video = store.create("app", "pool", {"model": "m", "prompt": "p"}, "a", "spec")
    assert store.report(video["id"], "a", 1, progress=30)
    deadline = time.time() + 30
    while swept_get(store, video["id"])["progress"] != 0:  # a stopped reporting: released
        assert time.time() < deadline
        time.sleep(0.1)
    assert store.claim(["pool"], hold_s=60)[0][0] == video["id"]
    while swept_get(store, video["id"])["status"] != "failed":  # no group adopted it in lost_wait_s
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
    while store.get("app", video["id"]) is not None:  # a read leaves an expired job out at once
        assert time.time() < deadline
        time.sleep(0.1)
    while list((tmp_path / "media").iterdir()):  # its row and files go at the next sweep
        assert time.time() < deadline
        store.claim(["no such pool"], hold_s=1)
        time.sleep(0.1)
    assert swept_get(store, video["id"]) is None
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


def test_a_database_outage_longer_than_stale_after_s_releases_no_job(tmp_path):
    """PostgreSQL stopped for twice ``stale_after_s`` under a running job: every call meanwhile
    raises ``StoreUnavailableError`` (a 503, never a 500); once it is back, the job is still its
    owner's, at its progress, and the owner's report and completion land."""
    if server_binaries() is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl): install Debian's postgresql package")
    with postgres_running() as server:
        store = make(server.url, tmp_path / "media", stale_after_s=0.5, lost_wait_s=0.5)
        _, video = store.create("app", "pool", {"model": "m"}, "a", "spec")
        assert store.report(video["id"], "a", 1, progress=40, running=True)
        server.stop()
        outage_ends = time.monotonic() + 1.5
        while time.monotonic() < outage_ends:
            for call in (lambda: store.get("app", video["id"]), lambda: store.report(video["id"], "a", 1, 50)):
                with pytest.raises(StoreUnavailableError) as raised:
                    call()
                assert "postgres" not in str(raised.value) and "socket" not in str(raised.value)
            time.sleep(0.1)
        server.start()
        with contextlib.suppress(StoreUnavailableError):  # a pooled connection that died with the server fails once
            store.claim(["no such pool"], hold_s=1)
        kept = swept_get(store, video["id"])  # the first sweep back: the owner's silence did not count
        assert (kept["status"], kept["progress"], kept["attempt"]) == ("in_progress", 40, 1), kept
        assert store.report(video["id"], "a", 1, progress=60)
        assert store.complete(video["id"], "a", 1, b"mp4", b"png")
        assert store.get("app", video["id"])["status"] == "completed"


def test_a_stalled_store_releases_no_job_and_a_silent_owner_is_released(tmp_path):
    """The leases count an owner's silence on the store's monotonic clock (a step of the wall
    clock cannot move it), and only while the store ran calls: a store that ran no call for a
    minute (stalled) releases nothing; an owner silent for ``stale_after_s`` while the store heard
    others is released."""
    now = [0.0]
    store = make(f"sqlite:///{tmp_path / 'jobs.sqlite'}", tmp_path / "media", stale_after_s=10, lost_wait_s=600)
    store.state.leases = JobLeases(clock=lambda: now[0])
    _, video = store.create("app", "pool", {"model": "m"}, "a", "spec")
    _, other = store.create("app", "pool", {"model": "m"}, "b", "spec")
    now[0] += 60  # the store ran no call for a minute
    store.sweeper.swept_at = 0.0
    assert store.get("app", video["id"])["status"] == "queued"
    assert store.claim(["pool"], hold_s=1) == []  # nothing was released
    for _ in range(12):  # b reports every second; a says nothing
        now[0] += 1
        store.sweeper.swept_at = 0.0
        assert store.report(other["id"], "b", 1, running=True)
    store.sweeper.swept_at = 0.0
    [(video_id, *_)] = store.claim(["pool"], hold_s=1)
    assert video_id == video["id"]
    assert store.report(video["id"], "a", 1) is False  # a's copy, were it alive, stops


def test_attempts_are_bounded_and_the_failure_names_each(store_url, tmp_path):
    store = make(store_url, tmp_path / "media", max_attempts=3)
    _, video = store.create("app", "pool", {"model": "m"}, "a", "spec")
    owner, attempt = "a", 1
    for n in range(3):
        assert store.report(video["id"], owner, attempt, running=True)
        if n == 1:  # a full group's release costs no attempt
            assert store.release(video["id"], owner, attempt, "overloaded", "full")
            attempt = store.adopt(video["id"], owner, attempt)
        assert store.release(video["id"], owner, attempt, "group_failed", f"rank died ({n})")
        if n < 2:
            owner, attempt = f"r{n}", store.adopt(video["id"], f"r{n}", attempt)
    failed = store.get("app", video["id"])
    assert failed["status"] == "failed" and failed["error"]["code"] == "group_failed"
    message = failed["error"]["message"]
    assert message.startswith("3 attempts failed (video_max_attempts=3)"), message
    assert all(f"rank died ({n})" in message for n in range(3)) and "full" not in message


def test_a_create_sent_again_to_its_own_replica_is_not_a_retry(store_url, tmp_path):
    store = make(store_url, tmp_path / "media")
    _, video = store.create("app", "pool", {"model": "m"}, "a", "spec", "video_same")
    assert store.report("video_same", "a", 1, running=True)
    _, again = store.create("app", "pool", {"model": "m"}, "a", "spec", "video_same")
    assert (again["attempt"], again["retried"]) == (2, False)  # the same replica runs it on
    assert store.report("video_same", "a", 2, running=True)
    _, moved = store.create("app", "pool", {"model": "m"}, "b", "spec", "video_same")
    assert (moved["attempt"], moved["retried"]) == (3, True)


def test_the_byte_cap_counts_files_being_written_and_a_missing_file_is_gone(store_url, tmp_path):
    store = make(store_url, tmp_path / "media", max_bytes=1000)
    _, video = store.create("app", "pool", {"model": "m"}, "a", "spec")
    report = dict(video_id=video["id"], attempt=1, progress=95, media_bytes=1500)
    assert store.renew("a", [report]) == [True]
    status, why = store.create("app", "pool", {"model": "m"}, "a", "spec")
    assert status == "full" and "1500 bytes" in why
    assert store.complete(video["id"], "a", 1, b"m" * 1400, b"p" * 100)
    (tmp_path / "media" / f"{video['id']}-1.mp4").unlink()
    status, why = store.content("app", video["id"], "video")
    assert status == "gone" and "missing from the media store" in why


def test_an_earlier_versions_database_gets_the_new_columns(tmp_path):
    """A lasting store written before ``attempt_errors`` existed opens, and its jobs go on."""
    from sqlalchemy import create_engine, text

    url = f"sqlite:///{tmp_path / 'jobs.sqlite'}"
    store = make(url, tmp_path / "media")
    _, video = store.create("app", "pool", {"model": "m"}, "a", "spec")
    with create_engine(url).begin() as conn:
        conn.execute(text("ALTER TABLE ray_hsdp_video_jobs DROP COLUMN attempt_errors"))
    again = JobStore(url, str(tmp_path / "media"))
    assert again.release(video["id"], "a", 1, "group_failed", "rank died")
    assert again.get("app", video["id"])["status"] == "queued"


def test_a_create_that_arrives_after_its_delete_is_refused(store_url, tmp_path):
    """A sync caller that leaves during its create deletes the id it picked; the create, still on
    its way, is then refused rather than run unwatched."""
    store = make(store_url, tmp_path / "media")
    assert store.delete("app", "video_early") is False
    status, why = store.create("app", "pool", {"model": "m"}, "a", "spec", "video_early")
    assert status == "deleted" and "deleted before its create" in why
    assert store.get("app", "video_early") is None


def test_a_steady_report_reads_no_row_and_a_transition_makes_the_next_read_it(store_url, tmp_path):
    """A report that changes nothing is answered from the rows the reports read last; a transition
    (here another job's create and a release) makes the next report read its row again, and a
    report of a released job is refused."""
    from sqlalchemy import event

    store = make(store_url, tmp_path / "media")
    _, video = store.create("app", "pool", {"model": "m"}, "a", "spec")
    statements = []
    event.listen(store.reads, "before_cursor_execute", lambda *args: statements.append(args[2]))
    assert store.report(video["id"], "a", 1, progress=10, running=True)  # a read, then its write
    assert len(statements) == 2
    assert all(store.report(video["id"], "a", 1, progress=10) for _ in range(5))
    assert len(statements) == 2  # steady: from memory
    store.create("app", "pool", {"model": "m"}, "b", "spec")
    assert store.report(video["id"], "a", 1, progress=10) and len(statements) == 3  # read again
    assert store.release(video["id"], "a", 1, "group_failed", "its group failed")
    assert store.report(video["id"], "a", 1, progress=10) is False


def test_rows_read_while_a_transition_ended_are_not_held():
    from ray_hsdp.serve.jobs.reports import Held, HeldJobs

    held, row = HeldJobs(), Held("in_progress", "a", 1, 10, 0)
    version, rows = held.read(["v"])
    assert rows == {}
    held.changed()  # a transition ended while the report read its row
    held.keep(version, {"v": row})
    assert held.read(["v"])[1] == {}
    version, _ = held.read(["v"])
    held.keep(version, {"v": row})
    assert held.read(["v"])[1] == {"v": row}
