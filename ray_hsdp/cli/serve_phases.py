"""Where the seconds of ``ray-hsdp serve`` go, from the command to its first ``/health`` 200: a
table of phases (this process's imports, Ray's start, Serve's start, the application's build, the
deploy until every replica runs, each model's group within it, the health check's lag), as a
group's start prints its own."""

from __future__ import annotations

import os
import threading
import time

#: What the application's build imports (the warm-up shapes' check reads the model with diffusers):
#: imported beside Ray's and Serve's starts instead of after them.
HEAVY_MODULES = ("torch", "diffusers", "transformers")


def process_age_s() -> float:
    """Seconds since this process started (Linux ``/proc``; 0 where it cannot be read): the
    interpreter's start and the CLI's imports, before any phase is timed."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def import_beside() -> threading.Thread:
    """Imports ``HEAVY_MODULES`` in a thread of their own (Python's import lock makes a later import
    wait for it, never import twice)."""

    def run() -> None:
        import importlib

        for module in HEAVY_MODULES:
            try:
                importlib.import_module(module)
            except ImportError:
                pass

    thread = threading.Thread(target=run, name="ray_hsdp-imports", daemon=True)
    thread.start()
    return thread


class ServeClock:
    """The phases of one ``ray-hsdp serve``, in order, each timed from the end of the one before."""

    def __init__(self):
        self.rows: list[tuple[str, float]] = [("interpreter and CLI imports", round(process_age_s(), 2))]
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.rows.append((phase, round(now - self._last, 2)))
        self._last = now

    def table(self, groups: dict[str, dict]) -> str:
        """The phases as a Markdown table, each model's group's start phases (``describe()["start"]``)
        beneath the deploy that waited for them."""
        total = sum(seconds for _, seconds in self.rows)
        lines = [f"Ready in {total:.1f} s:", "| phase | seconds |", "| --- | --- |"]
        for phase, seconds in self.rows:
            lines.append(f"| {phase} | {seconds:.2f} |")
            if phase.startswith("deploy"):
                for model, phases in groups.items():
                    for name, value in phases.items():
                        lines.append(f"|   {model}'s group: {name} | {value:.2f} |")
        return "\n".join(lines)


def group_starts(app_name: str, models: list[str], timeout_s: float = 30.0) -> dict[str, dict]:
    """Each model's group's start phases, asked of the application's ingress (``/v1/pool``'s)."""
    from ray import serve

    handle = serve.get_app_handle(app_name)
    out = {}
    for model in models:
        try:
            pool = handle.pool.remote(model).result(timeout_s=timeout_s)
            out[model] = pool["start"]["phases_s"]
        except Exception as err:  # noqa: BLE001 - the table says what it could not learn
            out[model] = {f"unknown ({type(err).__name__})": 0.0}
    return out


def wait_healthy(url: str, timeout_s: float = 120.0) -> bool:
    """Polls ``url``/health until it answers 200 (the ingress' first check of every model)."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    return False
