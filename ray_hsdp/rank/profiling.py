"""Where a rank's time goes: its tick log, its requests' phases and, on CUDA, how busy the GPU
was and with which kinds of kernels (from the torch profiler's trace)."""

from __future__ import annotations

import gzip
import json
import re
import shutil
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

from ray_hsdp.runtime import BUSY, IDLE, RankRuntime
from ray_hsdp.runtime.core import Observer

#: Kernel kinds, by name, first match wins.
KERNEL_KINDS = (
    ("collective", re.compile(r"nccl", re.I)),
    # (SageAttention's: its attention kernels, "..._attn_...", and the layout and quantization of q, k and v.)
    (
        "attention",
        re.compile(
            r"flash|fmha|attention|attn|sdpa|quant_per_block|mean_scale_fuse_quant|TransposePadPermute|"
            r"quant_(query|key)_per_thread",
            re.I,
        ),
    ),
    ("matmul", re.compile(r"gemm|cutlass|nvjet|cublas|matmul|sm90_xmma|wgmma", re.I)),
    ("conv", re.compile(r"conv|cudnn|winograd|implicit", re.I)),
)
_GAP_S = 0.005


def kernel_kind(name: str) -> str:
    """The kind of a CUDA kernel, from its name."""
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), "other")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def kernel_summary(trace: dict) -> dict:
    """How busy the GPU was over a chrome trace of the torch profiler.

    Returns:
        ``window_s`` (first kernel start to last kernel end), ``busy_s`` (union of all kernels),
        ``compute_busy_s`` (union of all but collectives), per kind the summed kernel seconds,
        and the idle gaps longer than 5 ms.
    """
    kernels = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        return {"kernels": 0}
    spans = [(e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in kernels]
    busy = _union(spans)
    compute = _union([s for s, e in zip(spans, kernels) if kernel_kind(e["name"]) != "collective"])
    by_kind: dict[str, dict] = defaultdict(lambda: {"kernel_s": 0.0, "count": 0})
    for event in kernels:
        entry = by_kind[kernel_kind(event["name"])]
        entry["kernel_s"] += event["dur"] / 1e6
        entry["count"] += 1
    gaps = [b[0] - a[1] for a, b in zip(busy, busy[1:]) if b[0] - a[1] > _GAP_S]
    window = busy[-1][1] - busy[0][0]
    busy_s = sum(b - a for a, b in busy)
    return {
        "kernels": len(kernels),
        "window_s": round(window, 4),
        "busy_s": round(busy_s, 4),
        "busy_fraction": round(busy_s / window, 4) if window else 0.0,
        "compute_busy_s": round(sum(b - a for a, b in compute), 4),
        "by_kind": {k: {"kernel_s": round(v["kernel_s"], 4), "count": v["count"]} for k, v in sorted(by_kind.items())},
        "gaps_over_5ms": {
            "count": len(gaps),
            "total_s": round(sum(gaps), 4),
            "longest_s": round(max(gaps, default=0), 4),
        },
    }


def tick_summary(trace: list[tuple]) -> dict:
    """Time a rank's tick thread spent gathering and running, by what it brought to the tick.

    ``own``: a forward of its own was waiting; ``busy``: requests running, none at a forward;
    ``idle``: nothing to do. ``gather_s`` is the wait in the tick's all-gather (the other ranks
    and the GPU work queued before it), ``run_s`` the forwards and ghost passes after it.
    """
    out: dict[str, dict] = {}
    for start, state, module_id, gathered_at, done_at in trace:
        kind = "own" if state >= 0 else {BUSY: "busy", IDLE: "idle"}.get(state, "stop")
        entry = out.setdefault(kind, {"ticks": 0, "gather_s": 0.0, "run_s": 0.0, "with_forward": 0})
        entry["ticks"] += 1
        entry["gather_s"] += gathered_at - start
        entry["run_s"] += done_at - gathered_at
        entry["with_forward"] += module_id is not None
    return {k: {**v, "gather_s": round(v["gather_s"], 4), "run_s": round(v["run_s"], 4)} for k, v in out.items()}


class RankProfile(Observer):
    """One profiling window of a rank: while it runs, it is the runtime's observer.

    Args:
        device: ``"cuda"`` (the torch profiler records kernels) or ``"cpu"`` (tick log and phases only).
        runtime: The rank's runtime.
        trace_dir: Where to keep the gzipped chrome trace (``None``: not kept).
    """

    def __init__(self, device: str, runtime: RankRuntime, trace_dir: str | None = None):
        self.device = device
        self.runtime = runtime
        self.trace_dir = trace_dir
        self.requests: dict[str, dict] = {}
        self.ticks: list[tuple] = []
        self.forward_ticks: list[int] = []
        # The tick thread and the request threads report while stop() reads.
        self._lock = threading.Lock()
        self._profiler = None
        self._started = 0.0

    def start(self) -> None:
        self._started = time.perf_counter()
        if self.device == "cuda":
            import torch

            self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self._profiler.start()
        self.runtime.observer = self

    def tick(
        self,
        number: int,
        start: float,
        state: int,
        module_id: int | None,
        ran: bool,
        gathered_at: float,
        done_at: float,
    ) -> None:
        with self._lock:
            self.ticks.append((start, state, module_id, gathered_at, done_at))
            if ran:
                self.forward_ticks.append(number)

    def request(self, request_id: str, event: str) -> None:
        peak = None
        if self.device == "cuda":
            import torch

            # The CPU runs ahead of the GPU: a phase ends when its kernels have, so wait for them
            # (a profiling window's cost, outside it nothing waits).
            torch.cuda.synchronize()
            if event != "start":
                # The most memory held since the previous event (the request's run resets it at
                # its start); one request at a time per rank gives its phases their own peaks.
                peak = torch.cuda.max_memory_allocated()
                torch.cuda.reset_peak_memory_stats()
        now = round(time.perf_counter() - self._started, 4)
        with self._lock:
            record = self.requests.setdefault(request_id, {"steps": [], "step_peaks": []})
            if event == "step":
                record["steps"].append(now)
                record["step_peaks"].append(peak)
            else:
                record[event] = now
                if event == "end":
                    record["end_peak"] = peak

    def stop(self, rank: int) -> dict:
        """Ends the window; returns its summary (see ``kernel_summary`` and ``tick_summary``)."""
        self.runtime.observer = Observer()
        wall = time.perf_counter() - self._started
        with self._lock:
            requests = {
                rid: {**r, "steps": list(r["steps"]), "step_peaks": list(r["step_peaks"])}
                for rid, r in self.requests.items()
            }
            ticks = list(self.ticks)
        out: dict = {"rank": rank, "wall_s": round(wall, 4), "requests": requests}
        if self.runtime.modules is not None:
            out["ticks"] = tick_summary(ticks)
            # Tick numbers are the same on every rank: two lanes whose leaders list the same
            # number ran forwards at the same time.
            out["forward_ticks"] = list(self.forward_ticks)
        if self._profiler is not None:
            self._profiler.stop()
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / f"rank{rank}.json"
                self._profiler.export_chrome_trace(str(path))
                out["gpu"] = kernel_summary(json.loads(path.read_text()))
                if self.trace_dir:
                    Path(self.trace_dir).mkdir(parents=True, exist_ok=True)
                    with path.open("rb") as src, gzip.open(Path(self.trace_dir) / f"rank{rank}.json.gz", "wb") as dst:
                        shutil.copyfileobj(src, dst)
        return out
