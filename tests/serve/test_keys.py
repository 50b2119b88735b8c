"""No server answers strangers unless its config says so (issue 55): a replica that finds no API key
refuses to start where Serve's HTTP host is not a loopback address, and says every way to give one."""

from __future__ import annotations

import pytest

from ray_hsdp.config.app import AppConfig
from ray_hsdp.serve.ingress import refuse_keyless

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
    from ray_hsdp.serve.keys import KeyCheck

    check = KeyCheck.of("s3cret-key")
    assert check.matches("s3cret-key") and not check.matches("s3cret-kez") and not check.matches("")
    assert "s3cret" not in repr(check) + check.salt + check.digest
    assert KeyCheck.of("s3cret-key").salt != check.salt  # a salt of its own each time


def test_a_key_from_the_environment_loses_its_trailing_newline_as_one_from_a_file(monkeypatch, tmp_path):
    from ray_hsdp.serve.keys import KeyCheck, read_key

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

    from ray_hsdp.serve.keys import stored_key

    from .served import deploy

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
