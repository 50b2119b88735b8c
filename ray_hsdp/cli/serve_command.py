"""``ray-hsdp serve``: deploys one application where the command runs and removes it on Ctrl-C, at
any moment (while it deploys too); its options come from ``serve_cli``."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time


def cmd_serve(args: argparse.Namespace) -> int:
    """Deploys the application under its own name; Ctrl-C removes that application only, at any
    moment (while it deploys too), and stops Ray only where this command started it."""
    from ray_hsdp.cli.serve_phases import ServeClock, import_beside

    clock = ServeClock()
    import_beside()  # what the build imports, beside Ray's and Serve's starts
    from pydantic import ValidationError

    from ray_hsdp.cli.serve_flags import UsageError, default_app_name, file_application, serve_config, served_args
    from ray_hsdp.config.endpoint import served_models
    from ray_hsdp.serve.ingress.keys import read_api_key

    try:
        application = file_application(args.config, args.app) if args.config else {"args": {}}
        if "models" in application["args"]:  # one endpoint, several models: the file gives each
            fields = served_args(args, application["args"])
            served = served_models(fields)
        else:
            if not args.model:
                raise UsageError("MODEL is required (a diffusers pipeline folder, or 'tiny')")
            config = serve_config(args, application["args"])
            fields = config.model_dump(exclude_unset=True)
            served = served_models(fields)
        # Read once here and carried to every replica: a cluster started without the key in its
        # nodes' environment still asks for it. A key stored with `ray-hsdp key set` wins over it
        # (serve.ingress.keys' order): that is how a key carried here is rotated, with no redeploy.
        api_key = read_api_key(served.endpoint)
    except (UsageError, ValidationError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    clock.lap("configuration and key")
    drain_s = max(model.drain_timeout_s for model in served.models)
    what = ", ".join(served.names)
    import ray
    from ray import serve

    from ray_hsdp.serve.app import build_application

    name = args.name or application.get("name") or default_app_name(args.model or served.names[0])
    route_prefix = args.route_prefix or application.get("route_prefix") or "/"
    # Ctrl-C and a plain kill remove the application, also where the shell started this in the
    # background (which leaves SIGINT ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    started_ray = _start_ray(args)
    clock.lap("Ray start" if started_ray else "Ray connect")
    deploying, failed = False, None
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        clock.lap("Serve start")
        url = f"{_listening(args)}{route_prefix.rstrip('/')}"
        app = build_application(fields, api_key)
        clock.lap("application build (checks, job store)")
        _say_a_stored_key_wins(name)
        print(f"Deploying {what} as application {name!r} at {url} (Ctrl-C removes it)", flush=True)
        deploying = True  # from here the application may exist: every way out removes it
        serve.run(app, name=name, route_prefix=route_prefix)
        clock.lap("deploy: replicas started, groups loaded and warmed")
        _say_where_the_start_went(clock, name, served.names, url)
        print(f"Serving {what} as application {name!r} on {url} (POST /v1/images/generations); "
              "Ctrl-C removes it", flush=True)  # fmt: skip
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    except RuntimeError as err:  # Serve's word that the deploy failed (a replica's start raised)
        failed = err
        print(f"error: application {name!r} failed to deploy: {err}", file=sys.stderr)
    finally:
        if deploying:
            remove_application(name, drain_s + 60)
            _close_shares({model.gpu_share for model in served.models} - {None})
        if started_ray:
            ray.shutdown()
    return 1 if failed else 0


def _start_ray(args: argparse.Namespace) -> bool:
    """Connects to Ray, starting a Ray of its own where none is given; returns whether it started one."""
    import ray

    from ray_hsdp.config.group import rank_pool_env

    started_ray = not ray.is_initialized() and not (args.address or os.environ.get("RAY_ADDRESS"))
    if started_ray:  # its own Ray: idle workers import what a rank needs before any rank is asked for
        for key, value in rank_pool_env(args.rank_pool_size).items():
            os.environ.setdefault(key, value)
    ray.init(address=args.address, ignore_reinit_error=True)
    return started_ray


def _say_where_the_start_went(clock, name: str, models: list[str], url: str) -> None:
    """Prints the phase table of this start (``serve_phases``), once ``/health`` answers 200."""
    from ray_hsdp.cli.serve_phases import group_starts, wait_healthy

    groups = group_starts(name, models)
    wait_healthy(url)
    clock.lap("until /health answers 200")
    print(clock.table(groups), flush=True)


def _close_shares(shares: set[str]) -> None:
    """Removes the GPU shares this application's models used, once no model is left on them (a
    share outlives applications: another one of the cluster may still use it)."""
    import ray

    from ray_hsdp.serve.replica.gpu_share import SHARE_NAMESPACE, close_share, share_actor_name

    for share in sorted(shares):
        try:
            actor = ray.get_actor(share_actor_name(share), namespace=SHARE_NAMESPACE)
            if not ray.get(actor.states.remote(), timeout=10):
                close_share(share)
        except Exception:  # noqa: BLE001 - none runs, or it is gone with its cluster
            pass


def _say_a_stored_key_wins(name: str) -> None:
    """Notes that a key stored for application ``name`` (``ray-hsdp key set``, maybe long ago) is the
    one its replicas serve with, not this shell's: else a stale stored key would go unseen."""
    from ray_hsdp.serve.ingress.keys import stored_key

    if stored_key(name) is not None:
        print(f"note: a key stored with `ray-hsdp key set --app {name}` is in the cluster; the replicas serve with "
              f"it, not this shell's (`ray-hsdp key remove --app {name}` hands over to this one)",
              file=sys.stderr)  # fmt: skip


def _listening(args: argparse.Namespace) -> str:
    """The address Serve's HTTP proxies listen on: ``--host`` and ``--port``, unless Serve was
    running already (it keeps the options it started with: say so)."""
    from ray_hsdp.serve.ingress.routes import serve_http_options

    host, port = serve_http_options()
    if (host, port) != (args.host, args.port) and host is not None:
        print(f"note: Serve runs already on {host}:{port}; --host {args.host} --port {args.port} do not apply "
              "(serve shutdown first to change them)", file=sys.stderr)  # fmt: skip
    return f"http://{host or args.host}:{port or args.port}"


def remove_application(name: str, drain_s: float) -> None:
    """Removes Serve application ``name`` and waits until it is gone: its replicas drain their video
    jobs first (up to ``drain_s``); a second Ctrl-C stops its replicas at once."""
    import ray
    from ray import serve

    def gone(deadline_s: float) -> bool:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if name not in serve.status().applications:
                return True
            time.sleep(0.5)
        return False

    try:
        serve.delete(name, _blocking=False)
        print(f"removing application {name!r}: its replicas finish their video jobs first (up to {drain_s:.0f} s); "
              "Ctrl-C again stops them at once", file=sys.stderr, flush=True)  # fmt: skip
        try:
            removed = gone(drain_s + 30)
        except KeyboardInterrupt:
            replicas = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                        if a["name"].startswith(f"SERVE_REPLICA::{name}#")]  # fmt: skip
            for replica in replicas:  # Serve's replica actors; their ranks share their fate
                ray.kill(ray.get_actor(replica, namespace="serve"), no_restart=True)
            print(f"stopped {len(replicas)} replica(s) of {name!r} at once", file=sys.stderr, flush=True)
            removed = gone(60)
        if not removed:
            print(f"application {name!r} is still listed by Serve; `serve status` shows why", file=sys.stderr)
    except Exception as err:  # noqa: BLE001 - Serve itself may be gone already
        print(f"could not remove application {name!r}: {err}", file=sys.stderr)


def add_serve(sub) -> None:
    """The ``serve`` subcommand: where it serves, and every configuration field (``serve_cli``)."""
    from ray_hsdp.cli.serve_flags import add_serve_options

    p = sub.add_parser("serve", help="serve a diffusers pipeline folder over HTTP")
    p.add_argument(
        "model", nargs="?", help="diffusers pipeline folder, or 'tiny' (none where --config names several models)"
    )
    p.add_argument("--name", help="the Serve application's name (default: --config's, else the model folder's name)")
    p.add_argument("--route-prefix", help="the application's HTTP route prefix (default: --config's, else /)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (127.0.0.1 unless told otherwise)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS or a local cluster)")
    p.add_argument(
        "--rank-pool-size", type=int, metavar="N", help="where this command starts Ray: idle processes per node "
        "that imported torch, diffusers and transformers before a rank needs them (default: Ray's, the node's CPUs; "
        "0: none)",
    )  # fmt: skip
    add_serve_options(p)
    p.set_defaults(func=cmd_serve)
