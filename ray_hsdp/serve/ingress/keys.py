"""The API key: where a replica finds it, how a request's key is checked against it, and how it rotates.

A replica never holds the key itself, only ``KeyCheck``: a random salt and the SHA-256 digest of
salt and key. What ``ray-hsdp serve`` carries to the replicas, and what ``ray-hsdp key set`` stores
in the cluster, is that digest, so neither Serve's stored application nor the cluster's actors hold
the key (an API key is a long random token: a fast digest of it cannot be searched back). Neither
the key nor its digest is ever printed or logged.

Where an ingress replica finds its key: one order, first found wins, looked at again every few
seconds (``ingress.server.KEY_REFRESH_S``), so a rotation from any source reaches every replica
within 10 s with no restart:

1. ``stored``: stored in the cluster for the application's name by ``ray-hsdp key set --app NAME``
   (a detached actor in the ``ray_hsdp`` namespace: nothing on the nodes' disks or environments).
   It is the operator's latest word, so it wins over every other source, whichever way the
   application was deployed; ``ray-hsdp key remove`` hands back to the next source.
2. ``carried``: carried by ``ray-hsdp serve`` (read once in that command's own environment or
   ``--api-key-file``); it is fixed for the deployment's life: rotate it with ``key set``.
3. ``file``: ``api_key_file``, a file at one path on every node (a Kubernetes Secret mounted in
   each pod), read again at each look.
4. ``env``: the variable ``api_key_env`` (``RAY_HSDP_API_KEY``) in the environment of the
   replica's node.

``ray-hsdp key show --app NAME`` tells which source each ingress replica serves with (each replica
reports its source's name, never the key, to the cluster's key-value store).

A rotation by ``key set`` replaces the stored check in place: there is no moment without a key.
``key set --keep-old-for S`` accepts the old key beside the new one for ``S`` seconds of wall-clock
time (the key each replica served before, whatever its source, and the one stored before), so
clients move over while both work. A source that wins but cannot be read (an empty or unreadable
``api_key_file``, as while it is rewritten in place; a stored key the cluster does not answer for)
never opens a server: the replica keeps the key it serves and logs an error until it reads one
again. Only a source that is truly gone (``key remove`` with nothing after it) takes the key away,
and then a server that strangers may reach refuses every request (``KeyCheck.NONE``), never opens.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import ray

from ray_hsdp.config.endpoint import EndpointConfig

logger = logging.getLogger("ray_hsdp")

#: The Ray namespace of the stored keys' actors, and of the replicas' reports of their sources.
KEY_NAMESPACE = "ray_hsdp"

#: The sources of a replica's key, in the order a replica looks (the module's docstring).
STORED, CARRIED, FILE, ENV = "stored", "carried", "file", "env"
#: What a replica serves with where no source has a key: nothing asked (a loopback host, or
#: ``allow_unauthenticated``), or every request refused (a host strangers may reach).
OPEN, REFUSING = "none", "refusing"

#: What each source's name means, for ``ray-hsdp key show``.
SOURCE_WORDS = {
    STORED: "stored in the cluster (ray-hsdp key set)",
    CARRIED: "carried by ray-hsdp serve",
    FILE: "api_key_file",
    ENV: "the node's environment (api_key_env)",
    OPEN: "no key: serving anyone (loopback host or allow_unauthenticated)",
    REFUSING: "no key: refusing every request",
}

#: How long a replica's look at the stored key waits for the cluster to answer: a look that waits
#: longer keeps the key (and the next look comes at the next tick).
STORED_READ_TIMEOUT_S = 5.0

#: How many times, and how far apart, an empty key file is read again before it counts as empty:
#: a file rewritten in place (truncated, then written) is empty for a moment.
EMPTY_FILE_TRIES, EMPTY_FILE_WAIT_S = 3, 0.05


def _digest(salt: str, key: str) -> str:
    return hashlib.sha256(f"{salt}:{key}".encode()).hexdigest()


@dataclass(frozen=True)
class KeyCheck:
    """What checks a request's key: a salt and the digest of salt and key (not the key); during an
    overlap, earlier keys' checks too, each until its wall-clock time."""

    salt: str
    digest: str = field(repr=False)
    #: Earlier keys still accepted: ``(salt, digest, until)``, ``until`` a ``time.time()``.
    older: tuple[tuple[str, str, float], ...] = field(default=(), repr=False)
    #: Of a stored check: until when a replica that switches to it keeps accepting the key it
    #: served before (``key set --keep-old-for``); 0: not at all.
    keep_old_until: float = 0.0

    @classmethod
    def of(cls, key: str) -> KeyCheck:
        salt = secrets.token_hex(16)
        return cls(salt, _digest(salt, key))

    def matches(self, given: str) -> bool:
        """Whether ``given`` is the key, or an earlier key still accepted (compared in constant time)."""
        now = time.time()
        found = hmac.compare_digest(_digest(self.salt, given), self.digest)
        for salt, digest, until in self.older:
            found |= until > now and hmac.compare_digest(_digest(salt, given), digest)
        return found

    def is_key(self, key: str) -> bool:
        """Whether ``key`` is this check's own key (not an earlier one)."""
        return hmac.compare_digest(_digest(self.salt, key), self.digest)

    def same_key(self, other: KeyCheck | None) -> bool:
        """Whether ``other`` checks the same key with the same salt (the same source's same read)."""
        return other is not None and (self.salt, self.digest) == (other.salt, other.digest)

    def keeping(self, old: KeyCheck | None, until: float) -> KeyCheck:
        """This check, also accepting ``old``'s key, and the earlier keys ``old`` still accepts, until
        ``until`` (no later than they were accepted before); this check alone where ``until`` passed."""
        now = time.time()
        if old is None or until <= now:
            return self
        kept = {(salt, digest): u for salt, digest, u in self.older if u > now}
        candidates = [(old.salt, old.digest, until)] + [(s, d, min(u, until)) for s, d, u in old.older]
        for salt, digest, u in candidates:
            if digest and u > now and (salt, digest) != (self.salt, self.digest):
                kept[salt, digest] = max(u, kept.get((salt, digest), 0.0))
        return dataclasses.replace(self, older=tuple((s, d, u) for (s, d), u in kept.items()))

    def accepts_old_until(self) -> float:
        """The latest wall-clock time an earlier key is accepted until (0: none now)."""
        now = time.time()
        return max((until for _, _, until in self.older if until > now), default=0.0)


#: The check of a server whose key is gone where it may not serve without one: it matches nothing
#: (no SHA-256 digest is empty).
KeyCheck.NONE = KeyCheck("", "")


def switched(serving: KeyCheck | None, found: KeyCheck | None) -> KeyCheck | None:
    """What a replica serving ``serving`` serves once it found ``found``: ``serving`` itself where
    it is the same key, else ``found``, accepting ``serving``'s key as long as ``found`` says."""
    if found is not None and found.same_key(serving):
        return serving
    if found is None or serving is None:
        return found
    return found.keeping(serving, found.keep_old_until)


def read_key(path: str | None, env: str) -> str | None:
    """The key from the first line of the file at ``path`` when one is named, else from the variable
    ``env``; ``None`` when the variable is unset or blank. Stripped of white space either way: a
    Kubernetes Secret exposed as a file or as a variable often ends in a newline, which no client
    can send in its header.

    Raises:
        ValueError: ``path`` is named but missing, unreadable or empty (naming the path, never
            what it holds).
    """
    if not path:
        return (os.environ.get(env) or "").strip() or None
    for attempt in range(EMPTY_FILE_TRIES):
        if attempt:  # a file rewritten in place is empty until its writer has written it
            time.sleep(EMPTY_FILE_WAIT_S)
        try:
            lines = Path(path).read_text().strip().splitlines() if Path(path).is_file() else []
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"api_key_file {path} cannot be read ({type(err).__name__})") from None
        if lines and lines[0].strip():
            return lines[0].strip()
    raise ValueError(f"api_key_file {path} is missing or empty")


def read_api_key(config: EndpointConfig) -> str | None:
    """The API key from ``api_key_file`` or the ``api_key_env`` variable; ``None`` when neither is set."""
    return read_key(config.api_key_file, config.api_key_env)


@ray.remote(num_cpus=0)
class StoredKey:
    """One application's key check, kept in the cluster (``ray-hsdp key set``), replaced in place."""

    def __init__(self, check: KeyCheck | None = None):
        self._check = check
        self._version = secrets.token_hex(4) if check is not None else None

    def replace(self, check: KeyCheck, keep_old_for: float = 0.0) -> str:
        """Serves ``check`` from now, the key stored before accepted beside it for ``keep_old_for``
        seconds; returns the new version's label (random: nothing of the key)."""
        until = time.time() + keep_old_for if keep_old_for > 0 else 0.0
        self._check = dataclasses.replace(check.keeping(self._check, until), keep_old_until=until)
        self._version = secrets.token_hex(4)
        return self._version

    def state(self) -> tuple[KeyCheck, str] | None:
        return None if self._check is None else (self._check, self._version)

    def check(self) -> KeyCheck | None:
        return self._check


def _store_name(app: str) -> str:
    return f"api_key:{app}"


def _stored_actor(app: str):
    try:
        return ray.get_actor(_store_name(app), namespace=KEY_NAMESPACE)
    except ValueError:
        return None


def stored_state(app: str, timeout_s: float = 60) -> tuple[KeyCheck, str] | None:
    """The key check ``ray-hsdp key set`` stored for ``app`` and its version's label; ``None``: none."""
    actor = _stored_actor(app)
    return ray.get(actor.state.remote(), timeout=timeout_s) if actor is not None else None


def stored_key(app: str) -> KeyCheck | None:
    """The key check ``ray-hsdp key set`` stored for application ``app``; ``None`` when there is none."""
    state = stored_state(app)
    return state[0] if state is not None else None


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


def store_key(app: str, key: str, keep_old_for: float = 0.0) -> str:
    """Stores the check of ``key`` in the cluster for application ``app``, replacing one stored before
    in place (a replica that reads it meanwhile finds the old key or the new, never none); the key
    stored before stays accepted for ``keep_old_for`` seconds. Returns the new version's label."""
    if not key:
        raise ValueError("an empty API key")
    if keep_old_for < 0:
        raise ValueError(f"keep_old_for must be 0 or more seconds, not {keep_old_for:g}")
    # On the head node, as the job table: a cluster that loses its head loses Serve too, while a
    # worker node may go at any time, and the key with it (new replicas would then start keyless).
    # One actor for the application's life: two `key set` at once both find it (get_if_exists).
    options = {"name": _store_name(app), "namespace": KEY_NAMESPACE, "lifetime": "detached",
               "get_if_exists": True, "resources": {"node:__internal_head__": 0.001}}  # fmt: skip
    actor = StoredKey.options(**options).remote()
    return ray.get(actor.replace.remote(KeyCheck.of(key), keep_old_for), timeout=60)


class KeyUnreadable(ValueError):
    """The source that wins cannot be read now: a replica keeps the key it serves."""


class Found(NamedTuple):
    """Where a replica's key was found (``None``: nowhere), its check, and a stored key's version."""

    source: str | None
    check: KeyCheck | None
    version: str | None = None


def find_key(
    carried: KeyCheck | None,
    config: EndpointConfig,
    app: str,
    serving: KeyCheck | None = None,
    stored: Callable[[str], tuple[KeyCheck, str] | None] = stored_state,
) -> Found:
    """The key a replica of ``app`` serves with, in the module's order. A file or variable that holds
    the key ``serving`` checks gives ``serving`` back (a new salt for the same key would be a switch).

    Raises:
        KeyUnreadable: The first source that may hold a key cannot be read (the ones after it are
            not looked at: which one wins is unknown until it answers).
    """
    try:
        state = stored(app)
    except Exception as err:  # noqa: BLE001 - any failure to ask: the stored key is unknown, not gone
        raise KeyUnreadable(f"the key stored for {app!r} could not be read ({type(err).__name__}: {err})") from None
    if state is not None:
        return Found(STORED, state[0], state[1])
    if carried is not None:
        return Found(CARRIED, carried)
    try:
        key = read_api_key(config)
    except ValueError as err:
        raise KeyUnreadable(str(err)) from None
    if key is None:
        return Found(None, None)
    source = FILE if config.api_key_file else ENV
    return Found(source, serving if serving is not None and serving.is_key(key) else KeyCheck.of(key))


def _report_name(replica: str) -> bytes:
    return f"key_source:{replica}".encode()


class ReplicaKey:
    """The key one ingress replica serves with: found in the module's order at ``read`` (strict: at
    the start and at each reconfiguration) and at each ``refresh`` (never raises: an unreadable
    source keeps the key), and reported under the replica's Serve id for ``ray-hsdp key show``.

    Args:
        carried: The check ``ray-hsdp serve`` carried, or ``None``.
        app: The application's name (the stored key's).
        refuse: ``refuse(check, config)`` raises ``ValueError`` where ``check`` is ``None`` and the
            server may not serve without a key (``ingress.routes.refuse_keyless``).
        replica: The replica's full Serve id (its actor's name); "" reports nothing.
        stored: Reads the stored key (``stored_state``; a test gives its own).
    """

    def __init__(self, carried: KeyCheck | None, app: str, refuse: Callable, replica: str = "", stored=None):
        self.carried, self.app, self.replica = carried, app, replica
        self._refuse = refuse
        self._stored = stored or functools.partial(stored_state, timeout_s=STORED_READ_TIMEOUT_S)
        self.check: KeyCheck | None = None
        self.source, self.version, self.where = OPEN, None, None
        self.since = time.time()
        #: Why the winning source could not be read at the last look; ``None``: it was read.
        self.error: str | None = None
        self._lock = threading.Lock()  # a reconfiguration's read may run beside a refresh's

    def read(self, config: EndpointConfig) -> KeyCheck | None:
        """The check to serve with now, found in the module's order.

        Raises:
            KeyUnreadable: The source that wins cannot be read.
            ValueError: No source holds a key and the server may not serve without one.
        """
        with self._lock:
            found = find_key(self.carried, config, self.app, self.check, self._stored)
            check = switched(self.check, found.check)
            self._refuse(check, config)
            where = config.api_key_file if found.source == FILE else config.api_key_env
            self._serve(found.source or OPEN, check, found.version, where if found.source in (FILE, ENV) else None)
            if self.error is not None:
                logger.warning("The API key of %r is read again: serving with the key %s", self.app, self.source)
            self.error = None
            self._report()
            return check

    def refresh(self, config: EndpointConfig) -> KeyCheck | None:
        """The check to serve with now; where the winning source cannot be read, the one served."""
        try:
            return self.read(config)
        except KeyUnreadable as err:
            if self.error is None:  # once per outage: every few seconds would bury the log
                logger.error("The API key of %r cannot be read; the key %s stays until it can: %s",
                             self.app, self.source, err)  # fmt: skip
            self.error = str(err)
        except ValueError as err:  # no key anywhere, where strangers may reach: refuse, never open
            if self.check != KeyCheck.NONE:
                logger.error("The API key is gone; every request is refused until one is given: %s", err)
            with self._lock:
                self._serve(REFUSING, KeyCheck.NONE, None, None)
                self.error = None
        except Exception as err:  # noqa: BLE001 - the key stays as it was until the next look
            logger.warning("Reading the API key again failed: %s", err)
            self.error = f"{type(err).__name__}: {err}"
        self._report()
        return self.check

    def _serve(self, source: str, check: KeyCheck | None, version: str | None, where: str | None) -> None:
        if (source, version) != (self.source, self.version) or not (check is self.check or check == self.check):
            self.since = time.time()
        self.check, self.source, self.version, self.where = check, source, version, where

    def _report(self) -> None:
        """This replica's source, for ``key show``: its name and where (a path, a variable), when it
        switched and was last read, and why the last look failed; never the key or its digest."""
        if not self.replica:
            return
        record = {"source": self.source, "version": self.version, "where": self.where, "since": self.since,
                  "read_at": time.time(), "error": self.error, "node": ray.util.get_node_ip_address(),
                  "old_accepted_until": self.check.accepts_old_until() if self.check else 0.0}  # fmt: skip
        try:
            # Ray's own key-value store (Serve keeps its state there): one short record per
            # replica, with no actor of its own to start or keep.
            from ray.experimental.internal_kv import _internal_kv_put

            _internal_kv_put(_report_name(self.replica), json.dumps(record), namespace=KEY_NAMESPACE)
        except Exception as err:  # noqa: BLE001 - a report is for the operator; serving goes on without it
            logger.warning("Reporting the API key's source failed: %s", err)


#: How old a report of a replica that no longer runs is before ``replica_sources`` forgets it
#: (a replica reports at each look; one that just started may not be listed yet).
FORGET_AFTER_S = 120.0


def replica_sources(app: str, deployment: str = "OpenAIIngress") -> dict[str, dict | None]:
    """Each running ingress replica of ``app`` (its Serve id) -> its last report (``ReplicaKey``;
    ``None``: it has not reported yet). Reports of replicas gone for a while are removed."""
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_get, _internal_kv_list

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"  # Serve's replica actors' names (namespace serve)
    running = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)}
    reports: dict[str, dict | None] = dict.fromkeys(sorted(running))
    for name in _internal_kv_list(_report_name(prefix), namespace=KEY_NAMESPACE):
        raw = _internal_kv_get(name, namespace=KEY_NAMESPACE)
        replica = name.decode().removeprefix("key_source:")
        record = json.loads(raw) if raw else None
        if replica in running:
            reports[replica] = record
        elif record is None or time.time() - record["read_at"] > FORGET_AFTER_S:
            _internal_kv_del(name, namespace=KEY_NAMESPACE)
    return reports


def wait_for_replicas(app: str, done: Callable[[dict | None], bool], timeout_s: float) -> dict[str, dict | None]:
    """``replica_sources(app)`` once every running ingress replica's report is ``done``, or at
    ``timeout_s`` as it is then."""
    deadline = time.monotonic() + timeout_s
    while True:
        reports = replica_sources(app)
        if all(map(done, reports.values())) or time.monotonic() > deadline:
            return reports
        time.sleep(0.25)


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))


def describe(replica: str, report: dict | None) -> str:
    """One line of ``key show``: a replica, its node and the source it serves with (never the key)."""
    name = replica.removeprefix("SERVE_REPLICA::")
    if report is None:
        return f"{name}: not reported yet (starting)"
    words = SOURCE_WORDS.get(report["source"], report["source"])
    if report.get("where"):
        words += f" {report['where']}"
    if report.get("version"):
        words += f", version {report['version']}"
    line = f"{name} on {report['node']}: {words}, since {_clock(report['since'])}"
    if report.get("old_accepted_until", 0) > time.time():
        line += f"; the key before it accepted until {_clock(report['old_accepted_until'])}"
    if report.get("error"):
        line += f"; its last read failed (it keeps this key): {report['error']}"
    return line
