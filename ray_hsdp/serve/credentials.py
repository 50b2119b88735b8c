"""Secrets in the job store's locations: a database password and an object store's key stay out
of every message, log line and stored argument.

Serve keeps an application's ``args`` and its deployments' init args and shows them (``serve
config``, the dashboard's deployment info), so a URL that carries a password is refused at build
(``refuse_inline_secrets``); the database's password comes from ``job_store_password_file`` or
``job_store_password_env``, read by the store on its own node (``with_password``), and whatever
names a location in a message goes through ``redact_url`` first.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

#: The endpoint's fields that name where the job store keeps things, and where its password is.
STORE_FIELDS = ("job_store", "media_store")
PASSWORD_FIELDS = ("job_store_password_file", "job_store_password_env")

#: What a redacted secret reads as (SQLAlchemy's own mark for a hidden password).
HIDDEN = "***"

#: A query parameter whose value is a secret (``?password=``, ``?sslpassword=``, ``?secret=``,
#: ``?token=``, ``?key=``): libpq and fsspec read credentials from the query too. Not ``sslkey`` or
#: ``passfile``, which name files: a URL with them is no secret and must not be refused.
_SECRET_PARAM = re.compile(r"([?&](?:[^=&#]*(?:password|passwd|pwd|secret|token)[^=&#]*|key)=)[^&#]*", re.IGNORECASE)


def _sql_password(url: str) -> str | None:
    """The password SQLAlchemy reads in ``url`` (the one its engine would send); ``None``: none, or
    not a URL SQLAlchemy parses."""
    try:
        return make_url(url).password
    except (ArgumentError, ValueError):
        return None


def _userinfo_password(url: str) -> bool:
    """Whether ``url`` carries ``user:password@`` as ``urlsplit`` (and fsspec) reads it."""
    userinfo, at, _ = urlsplit(url).netloc.rpartition("@")
    return bool(at) and ":" in userinfo


def _redact_one(url: str) -> str:
    if "://" not in url:  # a plain path: nothing in it is a credential
        return url
    if _sql_password(url) is not None:
        # SQLAlchemy's reading decides where the password ends (it may hold '/' or '?' unquoted).
        url = make_url(url).render_as_string(hide_password=True)
    elif _userinfo_password(url):
        parts = urlsplit(url)
        userinfo, _, host = parts.netloc.rpartition("@")
        url = urlunsplit(parts._replace(netloc=f"{userinfo.split(':', 1)[0]}:{HIDDEN}@{host}"))
    return _SECRET_PARAM.sub(rf"\g<1>{HIDDEN}", url)


def redact_url(url: str | None) -> str | None:
    """``url`` with its secrets shown as ``***``: the password of a SQLAlchemy URL (as SQLAlchemy
    renders it with ``hide_password``), the ``key:secret@`` of an fsspec URL (each part of a chained
    one, ``simplecache::s3://...``), and secret-named query parameters. A URL without any, and a
    plain path, come back unchanged."""
    if not url:
        return url
    return "::".join(_redact_one(part) for part in url.split("::"))


def has_inline_secret(url: str | None) -> bool:
    """Whether ``url`` carries a password, key or token in itself (``redact_url`` would hide one)."""
    if not url:
        return False
    return any(
        "://" in part and (_sql_password(part) is not None or _userinfo_password(part) or _SECRET_PARAM.search(part))
        for part in url.split("::")
    )


def refuse_inline_secrets(fields: Mapping) -> None:
    """Refuses endpoint fields (an application's raw ``args``, or ``EndpointConfig.model_dump()``)
    whose store locations carry a secret, and password fields that have no database server to go
    to. Checked where the application is built, before pydantic reads the fields (its errors quote
    the input): the fields become Serve's stored ``args`` and the ingress' init args, which Serve
    shows.

    Raises:
        ValueError: Naming the field, its URL redacted, and where the secret goes instead.
    """
    job_store, media_store = (fields.get(f) if isinstance(fields.get(f), str) else None for f in STORE_FIELDS)
    if has_inline_secret(job_store):
        raise ValueError(
            f"job_store {redact_url(job_store)} carries a password in its URL, which Serve keeps and shows "
            "(serve config, the dashboard, the ingress' init args): write the URL without it and give the password "
            "in job_store_password_file (a file on the head node, e.g. a mounted Kubernetes Secret) or "
            "job_store_password_env (a variable in the head node's environment)"
        )
    if has_inline_secret(media_store):
        raise ValueError(
            f"media_store {redact_url(media_store)} carries a credential in its URL, which Serve keeps and shows "
            "(serve config, the dashboard, the ingress' init args): write the URL without it and give the "
            "credentials the way the storage's fsspec backend reads them on every node (for s3: "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or an instance role)"
        )
    named = [f for f in PASSWORD_FIELDS if fields.get(f) is not None]
    if len(named) == 2:
        raise ValueError("job_store_password_file and job_store_password_env are both set: give the password once")
    if named and (job_store is None or job_store.startswith("sqlite")):
        raise ValueError(
            f"{named[0]} is set, but job_store is {job_store or 'the default SQLite file'}, which takes no "
            f"password: name a database server in job_store, or remove {named[0]}"
        )


def read_password(password_file: str | None, password_env: str | None) -> str:
    """The database password from the file ``password_file`` (its first line, without the line's
    end: a mounted Kubernetes Secret often ends in one) or the variable ``password_env``, as this
    node has it. Messages name where it was looked for, never a password.

    Raises:
        ValueError: The file is missing, unreadable or empty, or the variable unset or empty.
    """
    if password_file:
        try:
            first = Path(password_file).read_text().splitlines()[:1]
        except OSError as err:
            raise ValueError(
                f"job_store_password_file {password_file} cannot be read on this node: {err.strerror}"
            ) from None
        if not first or not first[0]:
            raise ValueError(f"job_store_password_file {password_file} is empty")
        return first[0]
    password = os.environ.get(password_env or "")
    if not password:
        raise ValueError(
            f"job_store_password_env {password_env} is not set in the environment of the node where the job store "
            "runs (the head node)"
        )
    return password


def with_password(url: str, password_file: str | None, password_env: str | None) -> str:
    """``url`` with the database password from ``password_file`` or ``password_env`` (``read_password``);
    ``url`` itself where neither is named. Called where the store opens its database: the password
    exists only in that process."""
    if not (password_file or password_env):
        return url
    password = read_password(password_file, password_env)
    return make_url(url).set(password=password).render_as_string(hide_password=False)
