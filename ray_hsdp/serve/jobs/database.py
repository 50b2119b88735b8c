"""How the video job store reaches its database: its engines, and the wrapper of every store call
(the database opened at the first call that reaches it; a database that does not answer is a 503,
never a 500, and stops every owner's silence from counting)."""

from __future__ import annotations

import functools

from sqlalchemy import create_engine, event
from sqlalchemy.exc import DisconnectionError, InterfaceError, OperationalError

from ray_hsdp.serve.jobs.records import StoreUnavailableError

#: What a database that does not answer raises (a connection refused or lost, a locked SQLite file).
DATABASE_DOWN = (OperationalError, InterfaceError, DisconnectionError)


def engine_for(url: str, **options):
    """The SQLAlchemy engine of a store's database (SQLite in WAL mode; others bounded in time)."""
    if url.startswith("sqlite"):
        # Readers and writers wait for a write rather than fail.
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False}, **options)

        @event.listens_for(engine, "connect")
        def _wal(connection, _):  # a write then never blocks the readers
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=NORMAL")

        return engine
    # No ping per checkout (it doubled a call's round trips): a connection that died with its server
    # fails its next use once (a 503; the pool then opens new ones); a server that does not answer
    # is given up on in seconds, not after TCP's minutes.
    connect = {"connect_timeout": 5} if url.startswith("postgresql") else {}
    return create_engine(url, pool_timeout=10, connect_args=connect, **options)


def answering(method):
    """A store call (a method of an object whose ``state`` is the store's ``StoreState``): the
    database opened (tables made, columns added) at the first call that reaches it; a database that
    does not answer raises ``StoreUnavailableError`` (a 503 to a caller; an owner's report waits)
    and stops every owner's silence from counting (``JobLeases``). A transaction that changed a row
    (a transition's: the reports' own writes keep what they wrote) forgets the rows the reports
    hold as it commits (``StoreState.transaction``, ``jobs.reports``)."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        state = self.state
        state.leases.called()
        state.call.reached_database = False
        try:
            state.open()
            out = method(self, *args, **kwargs)
        except DATABASE_DOWN as err:
            state.leases.unreachable()
            cause = type(getattr(err, "orig", None) or err).__name__  # the class only: a message may name the URL
            raise StoreUnavailableError(
                f"the video job store's database does not answer ({cause}); running jobs go on and report once "
                "it does: retry shortly"
            ) from None
        if state.call.reached_database:  # (a report answered from memory says nothing of the database)
            state.leases.reachable()
        return out

    return call
