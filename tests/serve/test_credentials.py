"""Issue 82: the job store's database password (and a media store's key) never shows: not in a
message, not in what Serve keeps and shows of an application (its args, the ingress' init args,
``serve status``), not in the logs. The password comes from a file or a variable, read where the
store opens its database (``ray_hsdp.serve.credentials``)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml
from postgres import postgres_server, server_binaries
from support import wait_until

from ray_hsdp.serve.credentials import (
    has_inline_secret,
    read_password,
    redact_url,
    refuse_inline_secrets,
    with_password,
)

SECRET = "hunter2-Zq9"

#: Serve's own log line of an application's args, written at each build of a ``serve deploy``.
SERVE_LOGS_ARGS = b"Importing application 'leaky' with arguments"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql+psycopg://jobs:hunter2-Zq9@db:5432/jobs", "postgresql+psycopg://jobs:***@db:5432/jobs"),
        # SQLAlchemy decides where the password ends: quoted characters, a '/' left unquoted.
        ("postgresql://jobs:hunter2-Zq9%40x@db/jobs", "postgresql://jobs:***@db/jobs"),
        ("postgresql://jobs:hunter2-Zq9/x@db/jobs", "postgresql://jobs:***@db/jobs"),
        (
            "postgresql://jobs@db/jobs?sslmode=require&password=hunter2-Zq9",
            "postgresql://jobs@db/jobs?sslmode=require&password=***",
        ),
        ("s3://AKIA:hunter2-Zq9@bucket/videos", "s3://AKIA:***@bucket/videos"),
        ("simplecache::s3://AKIA:hunter2-Zq9@bucket/videos", "simplecache::s3://AKIA:***@bucket/videos"),
        ("s3://bucket/videos?key=AKIA&secret=hunter2-Zq9", "s3://bucket/videos?key=***&secret=***"),
    ],
)
def test_redact_url_hides_every_secret_of_a_url(url, shown):
    assert redact_url(url) == shown
    assert SECRET not in redact_url(url) and has_inline_secret(url)


@pytest.mark.parametrize(
    "url",
    [
        None,
        "/shared/ray_hsdp/media",
        "sqlite:////var/lib/ray_hsdp/jobs.sqlite",
        "postgresql+psycopg://postgres@/postgres?host=/tmp/socket",
        # Files that hold keys are named, not given: no secret in the URL.
        "postgresql://jobs@db/jobs?sslkey=/etc/keys/client.key&passfile=/etc/pgpass",
        "s3://bucket/videos",
    ],
)
def test_a_url_without_a_secret_is_shown_as_written(url):
    assert redact_url(url) == url and not has_inline_secret(url)


@pytest.mark.parametrize(
    ("fields", "mentions"),
    [
        ({"job_store": f"postgresql+psycopg://jobs:{SECRET}@db/jobs"}, "job_store_password_file"),
        ({"job_store": f"postgresql+psycopg://jobs@db/jobs?password={SECRET}"}, "job_store_password_env"),
        ({"media_store": f"s3://AKIA:{SECRET}@bucket/videos"}, "AWS_SECRET_ACCESS_KEY"),
        ({"job_store_password_env": "PGPASSWORD"}, "takes no password"),
        ({"job_store": "sqlite:////tmp/jobs.sqlite", "job_store_password_file": "/p"}, "takes no password"),
        (
            {"job_store": "postgresql://jobs@db/jobs", "job_store_password_file": "/p", "job_store_password_env": "X"},
            "give the password once",
        ),
    ],
)
def test_a_secret_in_the_fields_is_refused_with_a_message_that_shows_none(fields, mentions):
    with pytest.raises(ValueError, match=mentions) as refused:
        refuse_inline_secrets(fields)
    assert SECRET not in str(refused.value)


def test_the_password_is_read_from_a_file_or_a_variable_and_named_where_missing(tmp_path, monkeypatch):
    path = tmp_path / "password"
    path.write_text(f"{SECRET}\n")  # a mounted Kubernetes Secret often ends in a newline
    url = with_password("postgresql+psycopg://jobs@db/jobs", str(path), None)
    from sqlalchemy.engine import make_url

    assert make_url(url).password == SECRET and make_url(url).username == "jobs"
    monkeypatch.setenv("RAY_HSDP_TEST_DB_PASSWORD", SECRET)
    assert read_password(None, "RAY_HSDP_TEST_DB_PASSWORD") == SECRET
    assert with_password("postgresql://jobs@db/jobs", None, None) == "postgresql://jobs@db/jobs"
    with pytest.raises(ValueError, match="cannot be read on this node"):
        read_password(str(tmp_path / "absent"), None)
    (tmp_path / "empty").write_text("")
    with pytest.raises(ValueError, match="is empty"):
        read_password(str(tmp_path / "empty"), None)
    with pytest.raises(ValueError, match="RAY_HSDP_TEST_UNSET is not set"):
        read_password(None, "RAY_HSDP_TEST_UNSET")


def test_the_store_reads_its_password_where_it_runs_and_keeps_it_out_of_its_arguments(tmp_path, monkeypatch):
    """``StoreActor`` (as the store's process runs it) connects to a real PostgreSQL with the
    password of ``job_store_password_env``; what it was started with, and what it reports, carry none."""
    from ray_hsdp.serve.jobs.actor import StoreActor

    if server_binaries() is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl): install Debian's postgresql package")
    monkeypatch.setenv("RAY_HSDP_TEST_DB_PASSWORD", SECRET)
    with postgres_server() as url:  # trust authentication: it takes any password, and proves the connection
        store = StoreActor(url, str(tmp_path / "media"), password_env="RAY_HSDP_TEST_DB_PASSWORD")
        try:
            assert store.engine.url.password == SECRET  # what the engine sends
            assert SECRET not in repr(store.engine.url) and SECRET not in str(store.configured())
            store.configure("app", {"max_jobs": 1})  # a round trip to the database
        finally:
            store.engine.dispose()


def test_the_app_builder_refuses_an_inline_password_and_its_init_args_carry_none(ray_cluster, monkeypatch):
    """What Serve keeps and shows of an application: the ingress' init args. A URL with a password
    is refused before pydantic reads the args (its errors quote the input); with the password in a
    variable, nothing bound carries it."""
    from ray import cloudpickle

    from ray_hsdp.serve import app as app_module

    opened = []
    monkeypatch.setattr(app_module, "open_store", lambda *args, **kwargs: opened.append((args, kwargs)))
    monkeypatch.setenv("RAY_HSDP_TEST_DB_PASSWORD", SECRET)
    args = {"models": ["tiny-wan"], "media_store": "/shared/media"}
    with pytest.raises(ValueError, match="job_store_password_file") as refused:
        # A field pydantic refuses beside it: the secret is refused first (pydantic's errors quote the input).
        app_module.build_endpoint({**args, "job_store": f"postgresql://jobs:{SECRET}@db/jobs", "retry_after_s": 0})
    assert SECRET not in str(refused.value) and "postgresql://jobs:***@db/jobs" in str(refused.value)
    assert opened == []

    built = app_module.build_endpoint(
        {**args, "job_store": "postgresql://jobs@db/jobs", "job_store_password_env": "RAY_HSDP_TEST_DB_PASSWORD"}
    )
    init_args = built._bound_deployment.init_args
    assert init_args[0]["job_store"] == "postgresql://jobs@db/jobs"
    assert init_args[0]["job_store_password_env"] == "RAY_HSDP_TEST_DB_PASSWORD"
    assert SECRET.encode() not in cloudpickle.dumps((init_args, built._bound_deployment.init_kwargs))
    [(_, where)] = opened  # the store is told where the password is, not the password
    assert where == {"password_file": None, "password_env": "RAY_HSDP_TEST_DB_PASSWORD"}


def test_the_store_refuses_other_locations_without_showing_their_secrets(ray_cluster):
    """The cluster's one store, asked for by an endpoint with other locations: the refusal names
    both with their secrets as ``***``."""
    from ray_hsdp.serve.jobs.actor import open_store

    running = open_store(None, None)  # the session's store (its defaults), or started so
    assert running is not None
    with pytest.raises(ValueError, match="give every endpoint of the cluster the same") as refused:
        open_store(f"postgresql+psycopg://jobs:{SECRET}@db/jobs", f"s3://AKIA:{SECRET}@bucket/videos")
    message = str(refused.value)
    assert SECRET not in message
    assert "postgresql+psycopg://jobs:***@db/jobs" in message and "s3://AKIA:***@bucket/videos" in message


def test_a_deploy_with_an_inline_password_fails_showing_none_in_serve_status_or_the_logs(server):
    """A ``serve deploy`` (Serve's controller builds the application) of an endpoint whose
    ``job_store`` carries a password: ``DEPLOY_FAILED`` naming the password fields, the URL redacted
    in ``serve status``. In the session's Ray logs the password is only where Serve itself writes an
    application's args at each build (``Importing application ... with arguments``), which is why
    it is refused: no line of ray_hsdp's (the refusal, its traceback) holds it."""
    import ray
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    from .served import ROOT

    shared = yaml.safe_load((ROOT / "serve_configs" / "tiny_cpu.yaml").read_text())
    port = int(server.rsplit(":", 1)[1])
    leaky = {
        "name": "leaky",
        "route_prefix": "/leaky",
        "import_path": "ray_hsdp.serve:build_endpoint",
        "args": {
            "models": ["tiny-wan"],
            "job_store": f"postgresql+psycopg://jobs:{SECRET}@db/jobs",
            "media_store": "/shared/media",
        },
    }
    config = {**shared, "http_options": {"host": "127.0.0.1", "port": port}}
    config["applications"] = shared["applications"] + [leaky]
    _get_global_client().deploy_apps(ServeDeploySchema(**config))
    try:
        status = wait_until(
            lambda: (app := serve.status().applications.get("leaky")) and app.status == "DEPLOY_FAILED" and app,
            120,
            "the deploy failing",
            interval_s=0.5,
        )
        assert "job_store_password_file" in status.message and "postgresql+psycopg://jobs:***@db/jobs" in status.message
        assert SECRET not in str(serve.status())
        time.sleep(1)  # the build's log lines reach their files
        logs = Path(ray._private.worker.global_worker.node.get_session_dir_path()) / "logs"
        lines = [line for p in logs.rglob("*") if p.is_file() for line in p.read_bytes().splitlines()]
        leaked = [line for line in lines if SECRET.encode() in line and SERVE_LOGS_ARGS not in line]
        assert not leaked, leaked[:5]
        assert any(b"postgresql+psycopg://jobs:***@db/jobs" in line for line in lines)  # the refusal was logged
    finally:
        serve.delete("leaky")
