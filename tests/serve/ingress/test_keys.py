"""No server answers strangers unless its config says so (issue 55): a replica that finds no API key
refuses to start where Serve's HTTP host is not a loopback address, and says every way to give one."""

from __future__ import annotations

import pytest

from ray_hsdp.config.app import AppConfig
from ray_hsdp.serve.ingress.routes import refuse_keyless

CONFIG = AppConfig(model="tiny", device="cpu")


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.1.1", "localhost", "::1"])
def test_a_keyless_replica_serves_on_a_loopback_host(host):
    refuse_keyless(None, CONFIG, host)


@pytest.mark.parametrize("host", ["0.0.0.0", "198.51.100.7", "::", None])
def test_a_keyless_replica_refuses_a_host_strangers_reach_naming_every_way_to_give_a_key(host):
    with pytest.raises(ValueError) as refused:
        refuse_keyless(None, CONFIG, host)
    message = str(refused.value)
    for way in (
        "RAY_HSDP_API_KEY",
        "api_key_file",
        "ray-hsdp serve",
        "ray-hsdp key set",
        "127.0.0.1",
        "allow_unauthenticated: true",
    ):
        assert way in message, (way, message)
    refuse_keyless("a key", CONFIG, host)  # with a key it serves
    refuse_keyless(None, CONFIG.model_copy(update={"allow_unauthenticated": True}), host)  # or when told to


def test_a_key_check_holds_no_key_and_matches_only_the_key():
    from ray_hsdp.serve.ingress.keys import KeyCheck

    check = KeyCheck.of("s3cret-key")
    assert check.matches("s3cret-key") and not check.matches("s3cret-kez") and not check.matches("")
    assert "s3cret" not in repr(check) + check.salt + check.digest
    assert KeyCheck.of("s3cret-key").salt != check.salt  # a salt of its own each time


def test_a_key_from_the_environment_loses_its_trailing_newline_as_one_from_a_file(monkeypatch, tmp_path):
    from ray_hsdp.serve.ingress.keys import KeyCheck, read_key

    monkeypatch.setenv("RAY_HSDP_TEST_KEY", "s3cret-key\n")  # a Kubernetes Secret as a variable
    assert read_key(None, "RAY_HSDP_TEST_KEY") == "s3cret-key"
    assert KeyCheck.of(read_key(None, "RAY_HSDP_TEST_KEY")).matches("s3cret-key")
    (tmp_path / "key").write_text("s3cret-key\n")
    assert read_key(str(tmp_path / "key"), "RAY_HSDP_TEST_KEY") == "s3cret-key"
    monkeypatch.setenv("RAY_HSDP_TEST_KEY", " \n")
    assert read_key(None, "RAY_HSDP_TEST_KEY") is None  # blank: no key


def test_a_key_stored_in_the_cluster_reaches_replicas_that_have_no_other(server, tmp_path):
    """`ray-hsdp key set --app NAME` before the deploy: the replicas of NAME, whose nodes have no key
    in a file or their environment, ask for it. Issue 73: a `key set` of another key under a stream
    of requests takes effect with no restart (the old key 401 with OpenAI's `invalid_api_key`, the
    new one 200, within 30 s; every request answered, none but the old key's refused), and `key
    remove` takes it away (this loopback server then serves open)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import requests
    from ray import serve

    from ray_hsdp.serve.ingress.keys import stored_key

    from ..served import deploy

    ray_hsdp = [str(Path(sys.executable).with_name("ray-hsdp")), "key"]
    # With the newline a Secret exposed as a variable ends in: the key stored is the key without it.
    env = {**os.environ, "RAY_HSDP_API_KEY": "stored-s3cret\n"}
    set_key = subprocess.run([*ray_hsdp, "set", "--app", "stored"], env=env, capture_output=True, text=True)
    assert set_key.returncode == 0, set_key.stderr
    assert "stored-s3cret" not in set_key.stdout + set_key.stderr
    try:
        # No api_key_file, and a variable no node has: only the cluster holds the key.
        args = {"model": "tiny", "device": "cpu", "shard_size": 1, "api_key_env": "RAY_HSDP_TEST_NO_SUCH_KEY"}
        url = deploy(server, "stored", args)
        body = {"prompt": "a cat", "size": "64x64", "num_inference_steps": 1}
        keyless = requests.post(f"{url}/v1/images/generations", json=body, timeout=120)
        assert keyless.status_code == 401, keyless.text
        keyed = requests.post(
            f"{url}/v1/images/generations", json=body, headers={"Authorization": "Bearer stored-s3cret"}, timeout=120
        )
        assert keyed.status_code == 200, keyed.text
        assert stored_key("another-app") is None  # keys are per application
        rotate(ray_hsdp, env, f"{url}/v1/images/generations", body)
    finally:
        serve.delete("stored")
        subprocess.run([*ray_hsdp, "remove", "--app", "stored"], env=env, capture_output=True, text=True)
    assert stored_key("stored") is None


def rotate(ray_hsdp: list[str], env: dict, url: str, body: dict) -> None:
    """``key set`` of a new key, then ``key remove``, while a thread sends requests with the key it
    last saw work; every answer is checked."""
    import subprocess
    import threading

    import requests
    from support import wait_until

    def post(key: str | None) -> requests.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return requests.post(url, json=body, headers=headers, timeout=120)

    keys = {"current": "stored-s3cret"}
    answers: list[tuple[str, int, str]] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            key = keys["current"]
            response = post(key)
            answers.append((key, response.status_code, response.text))

    sender = threading.Thread(target=load, daemon=True)
    sender.start()
    try:
        rotated = subprocess.run([*ray_hsdp, "set", "--app", "stored"], env={**env, "RAY_HSDP_API_KEY": "rotated"},
                                 capture_output=True, text=True)  # fmt: skip
        assert rotated.returncode == 0, rotated.stderr
        wait_until(lambda: post("rotated").status_code == 200, 30, "the new key's 200", interval_s=0.5)
        keys["current"] = "rotated"
        refused = post("stored-s3cret")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key", refused.text
        removed = subprocess.run([*ray_hsdp, "remove", "--app", "stored"], env=env, capture_output=True, text=True)
        assert removed.returncode == 0 and "removed" in removed.stdout, removed.stderr
        wait_until(lambda: post(None).status_code == 200, 30, "serving open on its loopback host", interval_s=0.5)
    finally:
        stop.set()
        sender.join(timeout=120)
    assert answers and all(code in (200, 401) for _, code, _ in answers), answers
    assert all(key == "stored-s3cret" for key, code, _ in answers if code == 401), answers  # only the old key


# Issue 82, item 7: one order of sources, a rotation that reaches every replica whatever started it,
# an optional overlap, a stored key replaced in place, and no source that opens a server by being
# empty or unreadable.


def test_an_overlap_accepts_the_old_key_until_its_wall_clock_time_and_a_set_without_one_refuses_it_at_once():
    import dataclasses
    import time

    from ray_hsdp.serve.ingress.keys import KeyCheck

    old = KeyCheck.of("old-s3cret")
    both = KeyCheck.of("new-s3cret").keeping(old, time.time() + 60)
    assert both.matches("new-s3cret") and both.matches("old-s3cret") and not both.matches("other")
    assert both.accepts_old_until() > time.time()
    assert "s3cret" not in repr(both) and old.digest not in repr(both) and both.digest not in repr(both)
    # Its time passed (no sleep: an entry whose wall-clock time is behind us), the old key is refused.
    expired = dataclasses.replace(both, older=tuple((s, d, time.time() - 1) for s, d, _ in both.older))
    assert expired.matches("new-s3cret") and not expired.matches("old-s3cret")
    assert not KeyCheck.of("new-s3cret").keeping(old, time.time() - 1).matches("old-s3cret")
    # The next rotation with an overlap keeps both earlier keys, none longer than they were kept before.
    third = KeyCheck.of("third-s3cret").keeping(both, time.time() + 600)
    assert all(third.matches(k) for k in ("third-s3cret", "new-s3cret", "old-s3cret"))
    assert dict(((s, d), u) for s, d, u in third.older)[old.salt, old.digest] <= both.accepts_old_until()
    # One without an overlap (a leaked key): every earlier key is refused at once.
    fourth = KeyCheck.of("fourth-s3cret").keeping(third, 0.0)
    assert fourth.matches("fourth-s3cret") and not any(fourth.matches(k) for k in ("third-s3cret", "old-s3cret"))
    assert not KeyCheck.NONE.keeping(old, time.time() + 60).matches("")  # NONE stays matching nothing...
    assert not KeyCheck.of("x").keeping(KeyCheck.NONE, time.time() + 60).older  # ...and is never kept


class Stored:
    """A stand-in for the cluster's stored key (``ReplicaKey``'s ``stored``): a state, or an error."""

    def __init__(self):
        self.state, self.error = None, None

    def __call__(self, app: str):
        if self.error is not None:
            raise self.error
        return self.state

    def set(self, key: str, keep_old_for: float = 0.0, version: str = "v1") -> None:
        import dataclasses
        import time

        from ray_hsdp.serve.ingress.keys import KeyCheck

        until = time.time() + keep_old_for if keep_old_for else 0.0
        self.state = (dataclasses.replace(KeyCheck.of(key), keep_old_until=until), version)


def keyed_replica(carried=None, host="0.0.0.0", app="app"):
    """A ``ReplicaKey`` over a ``Stored`` stand-in, refusing keyless serving as the ingress does."""
    from ray_hsdp.serve.ingress.keys import ReplicaKey

    stored = Stored()
    replica = ReplicaKey(carried, app, lambda check, config: refuse_keyless(check, config, host, app), stored=stored)
    return replica, stored


def endpoint(tmp_path, key_file: bool = True, env: str = "RAY_HSDP_TEST_KEY"):
    from ray_hsdp.config.endpoint import EndpointConfig

    return EndpointConfig(api_key_file=str(tmp_path / "key") if key_file else None, api_key_env=env)


def test_one_order_of_sources_a_stored_key_wins_over_a_carried_one_a_file_and_the_environment(monkeypatch, tmp_path):
    """Issue 82, 7a and 7b: a key stored with `key set` is the operator's latest word: it wins over
    the key `ray-hsdp serve` carried, `api_key_file` and the nodes' environment; `key remove` hands
    back to the next source in the order."""
    from ray_hsdp.serve.ingress.keys import CARRIED, ENV, FILE, STORED, KeyCheck

    monkeypatch.setenv("RAY_HSDP_TEST_KEY", "env-s3cret")
    (tmp_path / "key").write_text("file-s3cret\n")
    replica, stored = keyed_replica(carried=KeyCheck.of("carried-s3cret"))
    check = replica.read(endpoint(tmp_path))
    assert replica.source == CARRIED and check.matches("carried-s3cret") and not check.matches("file-s3cret")
    stored.set("stored-s3cret")
    check = replica.refresh(endpoint(tmp_path))
    assert (replica.source, replica.version) == (STORED, "v1") and check.matches("stored-s3cret")
    assert not any(check.matches(k) for k in ("carried-s3cret", "file-s3cret", "env-s3cret"))
    stored.state = None  # key remove
    assert replica.refresh(endpoint(tmp_path)).matches("carried-s3cret") and replica.source == CARRIED

    replica, stored = keyed_replica()  # a Serve YAML's replica: nothing carried
    assert replica.read(endpoint(tmp_path)).matches("file-s3cret") and replica.source == FILE
    assert replica.where == str(tmp_path / "key")
    same = replica.check
    assert replica.refresh(endpoint(tmp_path)) is same  # the same key read again is no switch
    assert replica.read(endpoint(tmp_path, key_file=False)).matches("env-s3cret") and replica.source == ENV
    stored.set("stored-s3cret")
    assert replica.refresh(endpoint(tmp_path, key_file=False)).matches("stored-s3cret") and replica.source == STORED


def test_a_rotation_with_an_overlap_keeps_the_key_each_replica_served_whatever_its_source(tmp_path):
    """Issue 82, 7e: `key set --keep-old-for 60` over a key `ray-hsdp serve` carried: the replica
    accepts both until the overlap ends; the next `key set` without one refuses every earlier key."""
    from ray_hsdp.serve.ingress.keys import KeyCheck

    replica, stored = keyed_replica(carried=KeyCheck.of("carried-s3cret"))
    replica.read(endpoint(tmp_path, key_file=False))
    stored.set("stored-s3cret", keep_old_for=60)
    check = replica.refresh(endpoint(tmp_path, key_file=False))
    assert check.matches("stored-s3cret") and check.matches("carried-s3cret") and check.accepts_old_until() > 0
    assert replica.refresh(endpoint(tmp_path, key_file=False)) is check  # no switch while it stays
    stored.set("rotated-s3cret", version="v2")
    check = replica.refresh(endpoint(tmp_path, key_file=False))
    assert check.matches("rotated-s3cret") and replica.version == "v2"
    assert not check.matches("stored-s3cret") and not check.matches("carried-s3cret")


def test_an_empty_or_unreadable_source_never_opens_a_server_the_last_key_stays_and_an_error_says_why(
    tmp_path, monkeypatch, caplog
):
    """Issue 82, 7d: a key file rewritten in place is empty for a moment, a file may turn unreadable,
    the cluster may not answer for the stored key: each keeps the key served (one error per outage,
    naming the source, never the key), on a loopback host too, where no key would mean open. A key
    that is truly gone (`key remove`, nothing after it) refuses every request on a host strangers
    reach, and serves open only on a loopback host."""
    import logging

    from ray_hsdp.serve.ingress.keys import FILE, OPEN, REFUSING, STORED, KeyCheck

    monkeypatch.delenv("RAY_HSDP_TEST_KEY", raising=False)
    key_file = tmp_path / "key"
    key_file.write_text("file-s3cret\n")
    for host in ("0.0.0.0", "127.0.0.1"):
        replica, stored = keyed_replica(host=host)
        check = replica.read(endpoint(tmp_path))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ray_hsdp"):
            key_file.write_text("")  # rewritten in place: truncated, not written yet
            assert replica.refresh(endpoint(tmp_path)) is check and replica.source == FILE
            assert replica.refresh(endpoint(tmp_path)) is check  # the outage goes on: no second error
            key_file.write_bytes(b"\xff\xfe")  # unreadable as text
            assert replica.refresh(endpoint(tmp_path)) is check and "cannot be read" in replica.error
            key_file.write_text("file-s3cret\n")
            assert replica.refresh(endpoint(tmp_path)) is check and replica.error is None
            stored.error = TimeoutError("the store did not answer")
            assert replica.refresh(endpoint(tmp_path)) is check and "could not be read" in replica.error
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 2 and "api_key_file" in errors[0].getMessage(), [r.getMessage() for r in errors]
        assert "s3cret" not in caplog.text and check.digest not in caplog.text
        stored.error = None
        stored.set("stored-s3cret")
        assert replica.refresh(endpoint(tmp_path)).matches("stored-s3cret") and replica.source == STORED
        stored.state = None  # key remove, with no file and no variable after it: gone, not unreadable
        gone = replica.refresh(endpoint(tmp_path, key_file=False))
        assert (gone, replica.source) == ((KeyCheck.NONE, REFUSING) if host == "0.0.0.0" else (None, OPEN))


def test_a_key_file_that_cannot_be_read_is_an_error_naming_its_path_never_its_content(tmp_path):
    from ray_hsdp.serve.ingress.keys import read_key

    (tmp_path / "key").write_bytes(b"\xff\xfe s3cret")
    with pytest.raises(ValueError, match="cannot be read") as refused:
        read_key(str(tmp_path / "key"), "RAY_HSDP_TEST_KEY")
    assert str(tmp_path / "key") in str(refused.value) and "s3cret" not in str(refused.value)
    with pytest.raises(ValueError, match="missing or empty"):
        read_key(str(tmp_path / "absent"), "RAY_HSDP_TEST_KEY")


def test_key_set_refuses_no_key_and_a_negative_overlap_before_it_reaches_the_cluster(monkeypatch, capsys):
    from ray_hsdp.cli.commands import main

    monkeypatch.setenv("RAY_HSDP_API_KEY", "")
    assert main(["key", "set", "--app", "nowhere"]) == 2 and "no key" in capsys.readouterr().err
    monkeypatch.setenv("RAY_HSDP_API_KEY", "s3cret")
    assert main(["key", "set", "--app", "nowhere", "--keep-old-for", "-1"]) == 2
    refused = capsys.readouterr().err
    assert "--keep-old-for takes 0 or more seconds" in refused and "s3cret" not in refused


def test_key_set_rotates_the_key_ray_hsdp_serve_carried_on_every_replica_with_an_overlap_in_place(server):
    """Issue 82, 7a-7e end to end, on the path `ray-hsdp serve` takes (`build_application(args,
    key)`: the key carried): `key show` names the source of every ingress replica; `key set
    --keep-old-for 60` reaches every replica within 10 s (the command waits for each) with the
    carried key still accepted; a second `key set` replaces the stored key in place and refuses
    every earlier key; `key remove` hands back to the carried key. No output holds a key or digest."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import ray
    import requests
    from ray import serve

    from ray_hsdp.serve.app import build_application
    from ray_hsdp.serve.ingress.keys import CARRIED, STORED, replica_sources, stored_key

    cli = [str(Path(sys.executable).with_name("ray-hsdp")), "key"]

    def key(action: str, *flags: str, value: str = "") -> str:
        env = {**os.environ, "RAY_HSDP_API_KEY": value}
        done = subprocess.run([*cli, action, "--app", "carried", *flags], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "s3cret" not in done.stdout + done.stderr
        return done.stdout

    def status(token: str | None) -> int:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return requests.get(f"{server}/carried/v1/models", headers=headers, timeout=60).status_code

    args = {"model": "tiny", "device": "cpu", "shard_size": 1, "api_key_env": "RAY_HSDP_TEST_NO_SUCH_KEY"}
    serve.run(build_application(args, "carried-s3cret"), name="carried", route_prefix="/carried")
    try:
        sources = replica_sources("carried")
        assert sources and all(r["source"] == CARRIED for r in sources.values()), sources
        assert (status(None), status("carried-s3cret")) == (401, 200)

        shown = key("set", "--keep-old-for", "60", value="first-s3cret")
        digest = stored_key("carried").digest
        assert shown.count("stored in the cluster") == len(sources) and "NOT YET" not in shown, shown
        assert shown.count("the key before it accepted until") == len(sources), shown
        assert (status("first-s3cret"), status("carried-s3cret"), status(None)) == (200, 200, 401)

        actor = ray.get_actor("api_key:carried", namespace="ray_hsdp")._actor_id
        shown = key("set", value="second-s3cret") + key("show")
        assert ray.get_actor("api_key:carried", namespace="ray_hsdp")._actor_id == actor  # replaced in place
        assert (status("second-s3cret"), status("first-s3cret"), status("carried-s3cret")) == (200, 401, 401)
        reports = replica_sources("carried")
        assert all(r["source"] == STORED for r in reports.values()) and digest not in shown, reports

        shown = key("remove")
        assert "removed" in shown and shown.count("carried by ray-hsdp serve") == len(sources), shown
        assert (status("carried-s3cret"), status("second-s3cret")) == (200, 401)
    finally:
        serve.delete("carried")
        subprocess.run([*cli, "remove", "--app", "carried"], capture_output=True, text=True)
