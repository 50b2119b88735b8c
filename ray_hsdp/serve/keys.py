"""The API key: where a replica finds it, and how a request's key is checked against it.

A replica never holds the key itself, only ``KeyCheck``: a random salt and the SHA-256 digest of
salt and key. What ``ray-hsdp serve`` carries to the replicas, and what ``ray-hsdp key set`` stores
in the cluster, is that digest, so neither Serve's stored application nor the cluster's actors hold
the key (an API key is a long random token: a fast digest of it cannot be searched back).

Where a replica finds its key, first found first:

1. carried by ``ray-hsdp serve`` (read in that command's own environment or ``--api-key-file``);
2. ``api_key_file``, a file at one path on every node (a Kubernetes Secret mounted in each pod);
3. the variable ``api_key_env`` (``RAY_HSDP_API_KEY``) in the environment of the replica's node;
4. stored in the cluster for the application's name by ``ray-hsdp key set`` before the deploy
   (a detached actor in the ``ray_hsdp`` namespace: nothing on the nodes' disks or environments).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray

from ray_hsdp.config.endpoint import EndpointConfig

#: The Ray namespace of the stored keys' actors.
KEY_NAMESPACE = "ray_hsdp"


def _digest(salt: str, key: str) -> str:
    return hashlib.sha256(f"{salt}:{key}".encode()).hexdigest()


@dataclass(frozen=True)
class KeyCheck:
    """What checks a request's key: a salt and the digest of salt and key (not the key)."""

    salt: str
    digest: str = field(repr=False)

    @classmethod
    def of(cls, key: str) -> KeyCheck:
        salt = secrets.token_hex(16)
        return cls(salt, _digest(salt, key))

    def matches(self, given: str) -> bool:
        """Whether ``given`` is the key (compared in constant time)."""
        return hmac.compare_digest(_digest(self.salt, given), self.digest)


#: The check of a server whose key is gone where it may not serve without one: it matches nothing
#: (no SHA-256 digest is empty).
KeyCheck.NONE = KeyCheck("", "")


def read_key(path: str | None, env: str) -> str | None:
    """The key from the first line of the file at ``path`` when one is named, else from the variable
    ``env``; ``None`` when the variable is unset or blank. Stripped of white space either way: a
    Kubernetes Secret exposed as a file or as a variable often ends in a newline, which no client
    can send in its header.

    Raises:
        ValueError: ``path`` is named but missing or empty.
    """
    if path:
        lines = Path(path).read_text().strip().splitlines() if Path(path).is_file() else []
        if not lines or not lines[0].strip():
            raise ValueError(f"api_key_file {path} is missing or empty")
        return lines[0].strip()
    return (os.environ.get(env) or "").strip() or None


def read_api_key(config: EndpointConfig) -> str | None:
    """The API key from ``api_key_file`` or the ``api_key_env`` variable; ``None`` when neither is set."""
    return read_key(config.api_key_file, config.api_key_env)


@ray.remote(num_cpus=0)
class StoredKey:
    """One application's key check, kept in the cluster (``ray-hsdp key set``)."""

    def __init__(self, check: KeyCheck):
        self._check = check

    def check(self) -> KeyCheck:
        return self._check


def _store_name(app: str) -> str:
    return f"api_key:{app}"


def _stored_actor(app: str):
    try:
        return ray.get_actor(_store_name(app), namespace=KEY_NAMESPACE)
    except ValueError:
        return None


def stored_key(app: str) -> KeyCheck | None:
    """The key check ``ray-hsdp key set`` stored for application ``app``; ``None`` when there is none."""
    actor = _stored_actor(app)
    return ray.get(actor.check.remote(), timeout=60) if actor is not None else None


def remove_key(app: str, timeout_s: float = 60) -> bool:
    """Removes ``app``'s stored key (and waits until its name is free); whether there was one."""
    actor = _stored_actor(app)
    if actor is None:
        return False
    ray.kill(actor)
    deadline = time.monotonic() + timeout_s
    while _stored_actor(app) is not None:  # the name is released once the actor is dead
        if time.monotonic() > deadline:
            raise TimeoutError(f"the stored key of {app!r} was not removed within {timeout_s:g}s")
        time.sleep(0.1)
    return True


def store_key(app: str, key: str) -> None:
    """Stores the check of ``key`` in the cluster for application ``app``, replacing one stored before."""
    if not key:
        raise ValueError("an empty API key")
    remove_key(app)
    # On the head node, as the job table: a cluster that loses its head loses Serve too, while a
    # worker node may go at any time, and the key with it (new replicas would then start keyless).
    options = {"name": _store_name(app), "namespace": KEY_NAMESPACE, "lifetime": "detached",
               "resources": {"node:__internal_head__": 0.001}}  # fmt: skip
    actor = StoredKey.options(**options).remote(KeyCheck.of(key))
    ray.get(actor.check.remote(), timeout=60)


def replica_key(carried: KeyCheck | None, config: EndpointConfig, app: str) -> KeyCheck | None:
    """The key check a replica of application ``app`` serves with (the module's order); ``None``: no key."""
    if carried is not None:
        return carried
    key = read_api_key(config)
    return KeyCheck.of(key) if key else stored_key(app)
