"""The video job store's tables and how a row reads as an OpenAI video object.

SQLAlchemy Core, so one schema serves SQLite (the embedded default) and PostgreSQL (a cluster whose
ingress replicas run on several nodes). A job's request (its ``spec``: what another group needs to
run it again) is stored as JSON, never pickled: a database row is data, not code.
"""

from __future__ import annotations

import base64
import dataclasses
import json

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Float,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    and_,
    inspect,
    or_,
    select,
    text,
    update,
)

from ray_hsdp.request import GenerationRequest, StepCache

metadata = MetaData()

#: One row per video job. ``owner`` and ``attempt`` guard every change of state (``jobs.store``).
jobs_table = Table(
    "ray_hsdp_video_jobs",
    metadata,
    Column("id", String(80), primary_key=True),
    Column("endpoint", String(200), nullable=False, index=True),  # the application whose ingress took it
    Column("seq", BigInteger, nullable=False, index=True),  # creation order (time.time_ns at create)
    Column("model", String(400)),
    # The group deployment whose groups run it (``pool_of``): a released or waiting job moves only
    # among them (two applications may serve models of one name with other settings).
    Column("pool", String(400), nullable=False, index=True),
    Column("status", String(16), nullable=False),
    Column("progress", Integer, nullable=False, default=0),
    Column("attempt", Integer, nullable=False, default=1),  # 1, then +1 at each adoption
    Column("restarted", Boolean, nullable=False, default=False),  # an attempt that ran gave it up
    Column("owner", String(200)),  # the replica running this attempt; NULL while released
    Column("last_owner", String(200)),  # the replica that ran the last attempt (a placement avoids it)
    Column("replica", String(200)),  # public: the replica whose group runs (ran) it
    Column("heartbeat", Float, nullable=False),  # the last change of the row by its owner or a transition
    Column("waiting_since", Float, nullable=False),  # queued on its owner's group since
    Column("released_at", Float),  # set while it waits, owned by none, for a group (``release``)
    Column("released_code", String(40)),
    Column("released_why", Text),
    Column("claimed_until", Float, nullable=False, default=0.0),  # an ingress places it until then
    Column("created_at", Float, nullable=False),
    Column("completed_at", Float),
    Column("expires_at", Float),
    Column("error_code", String(40)),
    Column("error_message", Text),
    Column("fields", JSON, nullable=False),  # the public fields the create gave (prompt, size, ...)
    Column("spec", Text),  # the request as JSON (``encode_spec``); NULL once the job has ended
    Column("media_bytes", BigInteger, nullable=False, default=0),
    Column("media_key", String(200)),  # the stored files' stem (``jobs.media``)
    # Why each attempt that failed under its job gave it up ("attempt N (code): why"), in order: a
    # job fails, naming them, once ``max_attempts`` have (``JobEndings.release``).
    Column("attempt_errors", JSON),
)

#: Each endpoint's limits, so a restarted store applies them before its ingress calls again.
endpoints_table = Table(
    "ray_hsdp_video_endpoints",
    metadata,
    Column("endpoint", String(200), primary_key=True),
    Column("limits", JSON, nullable=False),
)


class StoreUnavailableError(RuntimeError):
    """The job store cannot answer now: its database does not answer, or its actor is restarting.
    Jobs go on running; their reports wait. (Its message never carries the database's URL.)"""


def unexpired(now: float):
    """The rows not yet past their ``expires_at`` at ``now`` (the sweep removes the others)."""
    return or_(jobs_table.c.expires_at.is_(None), jobs_table.c.expires_at > now)


def add_missing_columns(engine) -> None:
    """Adds the columns of ``jobs_table`` that a database written by an earlier version lacks
    (each is nullable or has a default there): a lasting store survives an upgrade."""
    have = {column["name"] for column in inspect(engine).get_columns(jobs_table.name)}
    with engine.begin() as conn:
        for column in jobs_table.columns:
            if column.name not in have:
                kind = column.type.compile(dialect=engine.dialect)
                conn.execute(text(f'ALTER TABLE {jobs_table.name} ADD COLUMN "{column.name}" {kind}'))


def pool_of(app_name: str, deployment: str) -> str:
    """The store's name of a group deployment: its application's name and its own."""
    return f"{app_name}#{deployment}"


#: A job's statuses that may still change.
ACTIVE = ("queued", "in_progress")


def job_row(conn, video_id: str, endpoint: str | None = None, *kept):
    """A job's row (of ``endpoint``, where given, and meeting ``kept``), or ``None``."""
    query = select(jobs_table).where(jobs_table.c.id == video_id, *kept)
    if endpoint is not None:
        query = query.where(jobs_table.c.endpoint == endpoint)
    return conn.execute(query).first()


def guarded(conn, video_id: str, owner: str | None, attempt: int | None, values: dict) -> bool:
    """One compare-and-set of a job's row: it is active (and, where given, ``owner``'s ``attempt``)."""
    c = jobs_table.c
    where = [c.id == video_id, c.status.in_(ACTIVE)]
    if owner is not None:
        where.append(c.owner == owner)
    if attempt is not None:
        where.append(c.attempt == attempt)
    return conn.execute(update(jobs_table).where(and_(*where)).values(values)).rowcount == 1


def public(row) -> dict:
    """The OpenAI video object of a row (plus our extension fields: ``attempt``, ``retried``, ``replica``)."""
    error = {"code": row.error_code, "message": row.error_message} if row.error_code else None
    return {
        "id": row.id,
        "object": "video",
        "status": row.status,
        "progress": row.progress,
        "created_at": int(row.created_at),
        "completed_at": int(row.completed_at) if row.completed_at is not None else None,
        "expires_at": int(row.expires_at) if row.expires_at is not None else None,
        "error": error,
        "attempt": row.attempt,
        "retried": row.restarted,  # another group runs (ran) it again from the start
        "replica": row.replica,
        **row.fields,
    }


def encode_spec(job: GenerationRequest, fps: int) -> str:
    """A job's request and frame rate as JSON (the image as base64)."""
    fields = dataclasses.asdict(job)
    if job.image is not None:
        fields["image"] = base64.b64encode(job.image).decode()
    return json.dumps({"job": fields, "fps": fps})


def decode_spec(text: str) -> tuple[GenerationRequest, int]:
    """The ``(request, fps)`` that ``encode_spec`` wrote."""
    data = json.loads(text)
    fields = data["job"]
    if fields.get("image") is not None:
        fields["image"] = base64.b64decode(fields["image"])
    if fields.get("cache") is not None:
        fields["cache"] = StepCache(**fields["cache"])
    fields["lora"] = tuple(tuple(pair) for pair in fields.get("lora") or ())
    if fields.get("sigmas") is not None:
        fields["sigmas"] = tuple(fields["sigmas"])
    return GenerationRequest(**fields), int(data["fps"])
