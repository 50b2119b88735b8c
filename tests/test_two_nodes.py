"""Two real Ray nodes (``ray start`` in two network namespaces, ``tests/netns.py``): the key from
a file at one path on every node, a keyless application refused on a host strangers reach, a key
stored from a worker node kept on the head, a group on each node, and the loss of one node.

Neither node has the API key in its environment: the application reads it from ``api_key_file``
(the Kubernetes Secret mounted in every pod, here one file both namespaces see). Ray's own token
authentication is on, the same token on both nodes and the deploying client.
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import openai
import pytest
import requests
import yaml
from netns import NODE_IPS, two_nodes
from support import wait_until

KEY = secrets.token_urlsafe(24)
AUTH = {"Authorization": f"Bearer {KEY}"}
PORT = 8000


def cluster_env() -> dict[str, str]:
    """This process's environment without the session cluster's address, the key or any RAY_
    setting, with Ray's token authentication on."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("RAY_")}
    return {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}


def serve_config(model: str, key_file: Path, keyless: bool) -> dict:
    """The served applications; with ``keyless``, a second one that has no key anywhere."""
    config = {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": PORT},  # not loopback: the key is required
        "applications": [
            {
                "name": "ray_hsdp",
                "route_prefix": "/",
                "import_path": "ray_hsdp.serve:build_app",
                "args": {
                    "model": model,
                    "device": "cpu",
                    "shard_size": 2,
                    "cpus_per_rank": 1,  # a group fills node B; node A holds one and a CPU more
                    "replicate_size": 2,
                    "mode": "batch",
                    "default_size": "64x64",
                    "api_key_file": str(key_file),
                    "video_stale_after_s": 3,
                },
            },
        ],
    }
    if keyless:  # no key anywhere (no file, a variable no node has, none stored): refused on 0.0.0.0
        config["applications"].append(
            {
                "name": "keyless",
                "route_prefix": "/keyless",
                "import_path": "ray_hsdp.serve:build_app",
                "args": {
                    "model": model,
                    "device": "cpu",
                    "shard_size": 1,
                    "cpus_per_rank": 0.5,
                    "api_key_env": "RAY_HSDP_TEST_NO_SUCH_KEY",
                },  # fmt: skip
            }
        )
    return config


#: Run on node A: where the stored key of application ``pinned`` lives, and how Serve ends the
#: keyless application (its replicas refuse to start, so it fails to deploy).
CLUSTER_FACTS = """
import sys, time
import ray
from ray import serve
ray.init(address=sys.argv[1], namespace="facts")
stored = ray.get_actor("api_key:pinned", namespace="ray_hsdp")
print("KEY-NODE", ray.get(stored.__ray_call__.remote(lambda self: ray.util.get_node_ip_address())))
deadline = time.monotonic() + 90
while time.monotonic() < deadline:
    app = serve.status().applications.get("keyless")
    if app is not None and app.status == "DEPLOY_FAILED":  # the replica's error is its deployment's message
        messages = " ".join(d.message for d in app.deployments.values())
        print("KEYLESS DEPLOY_FAILED", messages.replace(chr(10), " "))
        break
    time.sleep(0.5)
"""


def replica_nodes(proxy: str, seen: dict[str, set[str]]) -> bool:
    """Adds to ``seen`` the replica that answers ``/v1/pool`` -> the node addresses of its group's
    ranks; True once both replicas have answered. A call that fails or waits past its timeout (the
    proxy holds it while no replica is ready) is a "not yet"."""
    try:
        pool = requests.get(f"{proxy}/v1/pool", headers=AUTH, timeout=10)
    except requests.RequestException:
        return False
    if pool.status_code == 200:
        body = pool.json()
        seen[body["replica"]] = {rank["node_ip"] for rank in body["ranks"]}
    return len(seen) == 2


def client(proxy: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy}/v1", api_key=KEY, max_retries=0, timeout=60)


def video(proxy: str, steps: int, seed: int):
    return client(proxy).videos.create(
        prompt="A fox in the snow",
        size="64x64",
        extra_body={"num_frames": 5, "num_inference_steps": steps, "seed": seed},
    )


def ended(proxy: str, jobs: list, timeout_s: float) -> list:
    """The jobs once each has completed or failed (the last states seen when the deadline passes)."""
    states: list = []

    def all_ended():
        states[:] = [client(proxy).videos.retrieve(job.id) for job in jobs]
        return all(job.status in ("completed", "failed") for job in states)

    try:
        wait_until(all_ended, timeout_s, "every video job ending", 0.2)
    except AssertionError as err:
        raise AssertionError(f"{err}: {[(j.status, j.progress, j.replica, j.error) for j in states]}") from None
    return states


#: Denoising steps of the video jobs that load the groups before node B is lost, and of the
#: requests in flight on B's group when it is: enough to outlast the few seconds between their
#: start and the kill, few enough that their runs again on A's group fit the calls' timeouts.
LONG_STEPS = 160
IN_FLIGHT_STEPS = 100


def jobs_by_replica(proxy: str, jobs: list) -> dict[str, str]:
    """Job id -> the replica that runs it, of ``jobs`` running now."""
    states = [client(proxy).videos.retrieve(job.id) for job in jobs]
    return {job.id: job.replica for job in states if job.status == "in_progress"}


def busier_than(proxy: str, busy: str, idle: str) -> tuple[list, dict[str, str], set[str]]:
    """Long video jobs sent one at a time, each once the one before runs, until at least two run on
    ``busy``'s group and one on ``idle``'s; then those beyond one on ``idle``'s are deleted: the
    jobs kept, where each runs, and the ids of every job sent.

    The router sends a request to the least loaded group (``GroupAwareRouter``), so the jobs
    alternate between the groups, and a tie may go to the same group every time: the deletes, not
    the order, leave ``busy`` the busier, so that the router sends the next requests to ``idle``."""
    jobs: list = []
    where: dict[str, str] = {}

    def newest_runs() -> bool:
        where.clear()
        where.update(jobs_by_replica(proxy, jobs))
        return jobs[-1].id in where

    for seed in range(10, 18):
        jobs.append(video(proxy, steps=LONG_STEPS, seed=seed))
        wait_until(newest_runs, 20, "the newest job running", 0.1)
        counts = Counter(where.values())
        if counts[busy] >= 2 and counts[idle] >= 1:
            break
    else:
        raise AssertionError(f"the jobs did not run on both groups: {where}")
    extra = [job_id for job_id, replica in where.items() if replica == idle][1:]
    for job_id in extra:
        client(proxy).videos.delete(job_id)
    wait_until(lambda: not held_requests(proxy, idle) & set(extra), 20, "the deleted jobs stopped", 0.1)
    kept = [job for job in jobs if job.id in where and job.id not in extra]
    return kept, {job.id: where[job.id] for job in kept}, {job.id for job in jobs}


def held_requests(proxy: str, replica: str) -> set[str]:
    """The ids of the requests ``replica``'s group holds now, queued or running (through the
    ingress' ``/v1/pool``, which answers for one group of the model per call)."""
    for _ in range(20):
        pool = requests.get(f"{proxy}/v1/pool", headers=AUTH, timeout=30).json()
        if pool["replica"] == replica:
            return set(pool["requests"])
    return set()


def groups_requests(proxy: str) -> dict[str, dict]:
    """Replica -> the requests its group holds (``/v1/pool`` answers for one group per call)."""
    seen: dict[str, dict] = {}
    for _ in range(20):
        pool = requests.get(f"{proxy}/v1/pool", headers=AUTH, timeout=30).json()
        seen[pool["replica"]] = pool["requests"]
    return seen


def png_pixels(body: dict) -> np.ndarray:
    """The image of an images response, as pixels."""
    import base64
    import io

    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(body["data"][0]["b64_json"]))), dtype=np.float64)


def image_call(proxy: str, steps: int, answers: list, timeout_s: float = 60) -> None:
    """One synchronous image request; its status code and body (or the error that ended it) go to
    ``answers``."""
    try:
        reply = requests.post(
            f"{proxy}/v1/images/generations",
            headers=AUTH,
            json={"prompt": "A cat", "size": "64x64", "num_inference_steps": steps, "seed": 3},
            timeout=timeout_s,
        )
        answers.append((reply.status_code, reply.json() if reply.status_code == 200 else reply.text[:300]))
    except requests.RequestException as err:  # a hang would end here, at the timeout
        answers.append((None, repr(err)))


SYNC_BODY = {
    "prompt": "A synchronous fox",
    "size": "64x64",
    "num_frames": 5,
    "num_inference_steps": IN_FLIGHT_STEPS,
    "seed": 5,
}


def sync_video_call(proxy: str, answers: list, timeout_s: float = 120) -> None:
    """One synchronous video (``/v1/videos/sync``): its status code, its job's id and its MP4 (or
    the error that ended it) go to ``answers``."""
    try:
        reply = requests.post(f"{proxy}/v1/videos/sync", headers=AUTH, json=SYNC_BODY, timeout=timeout_s)
        body = reply.content if reply.status_code == 200 else reply.text[:300]
        answers.append((reply.status_code, reply.headers.get("X-Video-Id"), body))
    except requests.RequestException as err:
        answers.append((None, None, repr(err)))


def mp4_mae(a: bytes, b: bytes) -> float:
    """Mean absolute difference (0-255) of two MP4s' decoded frames."""
    from ray_hsdp.serve.media import decode_mp4

    return float(np.abs(decode_mp4(a)[0].astype(np.float64) - decode_mp4(b)[0]).mean())


@pytest.mark.timeout(480)
def test_two_nodes_serve_with_the_key_from_a_file_and_keep_serving_after_one_node_is_lost(tiny_model, tmp_path):
    key_file = tmp_path / "api_key"
    key_file.write_text(KEY + "\n")
    config, both = tmp_path / "serve.yaml", tmp_path / "serve-and-keyless.yaml"
    config.write_text(yaml.safe_dump(serve_config(tiny_model, key_file, keyless=False)))
    both.write_text(yaml.safe_dump(serve_config(tiny_model, key_file, keyless=True)))
    proxies = [f"http://{ip}:{PORT}" for ip in NODE_IPS]
    # Head: one group of 2 CPU ranks and a CPU to spare; the worker: exactly one group.
    with two_nodes((3, 2), cluster_env()) as nodes:
        try:
            serve = str(Path(sys.executable).with_name("serve"))
            # Deployed while node B joins: the second group waits for it.
            nodes.run(0, serve, "run", "--non-blocking", "--address", nodes.head, str(config))
            nodes.joined()
            groups: dict[str, set[str]] = {}
            wait_until(lambda: replica_nodes(proxies[0], groups), 180, "two groups serving", 0.5)
            # Each group's ranks on one node, the two groups on the two nodes.
            assert sorted(ip for ips in groups.values() for ip in ips) == sorted(NODE_IPS), groups

            # A key stored from node B lives on the head node, as the job table; the keyless
            # application (deployed beside the served one, which keeps running) is refused with
            # the message that names every way to give a key.
            nodes.run(0, serve, "run", "--non-blocking", "--address", nodes.head, str(both))
            cli = str(Path(sys.executable).with_name("ray-hsdp"))
            nodes.run(1, "env", f"RAY_ADDRESS={nodes.head}", "RAY_HSDP_API_KEY=pinned-key", cli, "key", "set",
                      "--app", "pinned")  # fmt: skip
            nodes.run(0, sys.executable, "-c", CLUSTER_FACTS, nodes.head)
            facts = nodes.logs[-1].read_text()
            assert f"KEY-NODE {NODE_IPS[0]}" in facts, facts
            assert "KEYLESS DEPLOY_FAILED" in facts and "is not a loopback address" in facts, facts
            on_b = next(replica for replica, ips in groups.items() if ips == {NODE_IPS[1]})

            for proxy in proxies:  # both nodes' proxies ask for the key
                keyless = requests.post(f"{proxy}/v1/images/generations", json={"prompt": "x"}, timeout=30)
                assert keyless.status_code == 401, (proxy, keyless.status_code, keyless.text)

            # The official client through each node's proxy; the jobs run on both groups.
            jobs = [video(proxies[i % 2], steps=10, seed=i) for i in range(4)]
            done = ended(proxies[0], jobs, 60)
            assert {job.status for job in done} == {"completed"}, [job.error for job in done]
            assert {job.replica for job in done} == set(groups), [job.replica for job in done]

            # Node B lost under load: its raylet killed while video jobs, a synchronous video and
            # image requests that entered through node A's proxy (A's ingress) run on the groups. A's
            # group holds more jobs than B's (one of them on B is what must move); the router sends
            # the sync video to a group it picks, read from the job store, not sampled.
            (on_a,) = set(groups) - {on_b}
            long_jobs, ran_on, sent = busier_than(proxies[0], busy=on_a, idle=on_b)
            answers: list = []
            synced: list = []
            # A sync video moved off B waits for its claim's release, then runs again on A: 200 s.
            calls = [threading.Thread(target=sync_video_call, args=(proxies[0], synced, 200))]
            calls[0].start()
            sync_job: list = []

            def sync_running() -> bool:
                jobs_now = client(proxies[0]).videos.list(limit=100).data
                sync_job[:] = [job for job in jobs_now if job.prompt == SYNC_BODY["prompt"]]
                return bool(sync_job) and sync_job[0].status == "in_progress"

            wait_until(sync_running, 30, "the sync video running", 0.1)
            sync_id, sync_ran_on = sync_job[0].id, sync_job[0].replica
            # The images go to either group (B's holds as many requests as A's now): those seen on
            # B through /v1/pool (which answers for the least loaded group) must be retried.
            calls += [
                threading.Thread(target=image_call, args=(proxies[0], IN_FLIGHT_STEPS, answers, 120)) for _ in range(2)
            ]
            for call in calls[1:]:
                call.start()
            images_on_b: set = set()

            def images_seen() -> bool:
                held = held_requests(proxies[0], on_b) - sent
                images_on_b.update(rid for rid in held if not rid.startswith("video_"))  # a job's id: "video_..."
                return len(images_on_b) == 2

            try:
                wait_until(images_seen, 1, "the image requests seen on B", 0.1)
            except AssertionError:
                pass  # not seen there, or not there: no image is known to be on B
            images_on_b -= {body["id"] for _, body in list(answers) if isinstance(body, dict)}
            at_kill = client(proxies[0]).videos.retrieve(sync_id)
            assert nodes.kill(1, "raylet"), "no raylet on node B"
            # A lost node's workers go with it: without its raylet a rank lives on until it notices,
            # and a request about to end there would still answer from B.
            nodes.kill(1, "ray::")
            for job_id, replica in ran_on.items():  # A's jobs only loaded A: B's are the ones to follow
                if replica == on_a:
                    client(proxies[0]).videos.delete(job_id)
            for call in calls:
                call.join(timeout=210)
            # Every request is answered 200: the ingress sent each whose group was lost to A's
            # group, with its seed, so it equals its lone run there (below); none hangs, no 500.
            assert [code for code, _ in answers] == [200] * len(answers) == [200, 200], answers
            shown = [{key: body.get(key) for key in ("retried", "first_error", "elapsed_s")} for _, body in answers]
            retried = [body for _, body in answers if body["retried"] and "was lost" in body["first_error"]]
            assert len(retried) >= len(images_on_b), (images_on_b, shown)
            # The sync video's job (where it ran is the store's record): on B as it was lost, it ran
            # again on A's group (same seed), one record, retried; on A, or ended on B before the
            # kill, it completed where it ran, not retried.
            ((code, answered_id, sync_mp4),) = synced
            state = client(proxies[0]).videos.retrieve(sync_id)
            assert code == 200 and answered_id == sync_id, (code, sync_mp4, state.status, state.replica, state.progress)
            record = client(proxies[0]).videos.retrieve(sync_id)
            moved = (record.status, record.replica, record.retried)
            lost_with_b = sync_ran_on == on_b and at_kill.status != "completed"
            expected = ("completed", on_a, True) if lost_with_b else ("completed", sync_ran_on, False)
            assert moved == expected, (moved, sync_ran_on, f"at the kill: {at_kill.status} {at_kill.progress}%")
            listed = client(proxies[0]).videos.list(limit=100).data
            assert [job.id for job in listed if job.prompt == SYNC_BODY["prompt"]] == [sync_id]
            # Each video job that ran on B completes on A's group (its replica stopped reporting; same
            # seed), leaving one completed record.
            on_b_jobs = [job for job in long_jobs if ran_on.get(job.id) == on_b]
            for job in ended(proxies[0], on_b_jobs, 90):
                assert (job.status, job.replica, job.retried) == ("completed", on_a, True), (job.status, job.error)
            # Node A's proxy keeps serving: the next requests succeed on A's group.
            wait_until(
                lambda: requests.post(
                    f"{proxies[0]}/v1/images/generations", headers=AUTH, json={"prompt": "after", "size": "64x64"},
                    timeout=60,
                ).status_code == 200,
                60, "a request answered after node B was lost", 0.5,
            )  # fmt: skip
            after: list = []
            for _ in range(3):
                image_call(proxies[0], 4, after)
            assert [code for code, _ in after] == [200, 200, 200], after
            lone: list = []
            image_call(proxies[0], IN_FLIGHT_STEPS, lone)  # the lost node's requests' lone run, on A's group
            assert lone[0][0] == 200, lone
            for _, body in answers:  # equal up to the PNG's rounding; the random seeds' images differ far more
                assert np.abs(png_pixels(body) - png_pixels(lone[0][1])).max() <= 1, (body["retried"], body["seed"])
            lone_sync: list = []
            sync_video_call(proxies[0], lone_sync)
            if lone_sync[0][0] != 200:  # what the job did, for the message
                states = [(j.id, j.status, j.replica, j.error) for j in client(proxies[0]).videos.list(limit=5).data]
                raise AssertionError(f"the lone sync video: {lone_sync[0][0]} {lone_sync[0][2]!r}; jobs {states}")
            assert mp4_mae(sync_mp4, lone_sync[0][2]) <= 0.2, lone_sync[0][:2]
            # The key is in no log of either node, Serve's and the ranks' included.
            logs = [path for path in nodes.temp_dir.rglob("logs/**/*") if path.is_file()]
            assert logs and not [path for path in logs if KEY.encode() in path.read_bytes()]
        except BaseException as err:
            raise AssertionError(f"{err}\n{nodes.tail()}") from err
    # Gone after the test: no namespace of this test, no process left in it.
    assert not [ns for ns in nodes.namespaces if ns in os.popen("ip netns list").read()]
