"""A few-step config served as its users run it, beside its model's 40-step default and plain
diffusers, on the same GPU in the same run.

    python -m bench.few_step plain --model /tmp/wan14b --lora /tmp/lightx2v --name few-step-wan2.1-t2v-14b-1xH100
    python -m bench.few_step serve --config serve_configs/wan2.1_t2v_14b_4step.yaml --model /tmp/wan14b \\
        --set loras.lightx2v=/tmp/lightx2v --set attention_backend=auto --name few-step-wan2.1-t2v-14b-1xH100

``plain``: plain diffusers on this GPU (``from_pretrained(...).to('cuda')``, bf16, SDPA, one warm-up
first): the long request (``--long-steps``, the model's default guidance and scheduler), then the
few-step one with the LoRA fused by diffusers itself (``load_lora_weights`` + ``fuse_lora``) and the
scheduler a diffusers user writes for it (flow-match Euler, shift 5, lightx2v's sigmas); its frames
are kept (``--frames-file``).

``serve``: ``serve run`` of a copy of the YAML, then ``--requests`` synchronous videos
(``POST /v1/videos/sync``, vllm-omni's multipart fields: prompt, width, height, num_frames, seed; the
adapter's defaults give the steps, the sigmas and the guidance), then one of ``--long-steps`` steps
with the model's default guidance and UniPC. For each, where its seconds went: the client's, from the
POST to the MP4's last byte; the group's run (its rank's text encoding, steps, and the decode with the
frames' copy to the host, from the replica's request line); the MP4's encoding (the same frames
encoded here, by the replica's encoder); the rest (HTTP, queues, the store, transfers); and the last
few-step MP4's frames against plain diffusers' (computed by the part that runs second, in either
order). Both parts write ``--out/--name``; the second writes the report of both (``report``
rewrites it from the two JSON files).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

from bench.common import ServedYaml, environment, write_results

PROMPT = "A red fox runs through fresh snow at dawn, cinematic"
_LINE = re.compile(r"ray_hsdp INFO request (\{.*\})\s*$")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("part", choices=["serve", "plain", "report"])
    parser.add_argument("--config", type=Path, default=Path("serve_configs/wan2.1_t2v_14b_4step.yaml"))
    parser.add_argument("--model", required=True)
    parser.add_argument("--lora", help="plain: the LoRA fused for the few-step request")
    parser.add_argument("--device", default="cuda", help="plain: where diffusers runs (cpu for a dry run)")
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--requests", type=int, default=3, help="few-step requests, one after another")
    parser.add_argument("--long-steps", type=int, default=40)
    parser.add_argument("--long-guidance", type=float, default=5.0)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a field of the args")
    parser.add_argument("--frames-file", type=Path, default=Path("/tmp/few-step-plain.npy"), help="plain's frames")
    parser.add_argument("--served-file", type=Path, default=Path("/tmp/few-step-served.npy"), help="served frames")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="few-step-wan2.1-t2v-14b")
    return parser


def request_lines(log: Path) -> dict[str, dict]:
    """The replica's structured request lines in a ``serve run`` log, by request id (a video job's id)."""
    lines = {}
    for text in log.read_text(errors="replace").splitlines():
        match = _LINE.search(text)
        if match:
            line = json.loads(match.group(1))
            lines[line["request_id"]] = line
    return lines


def sync_video(base: str, headers: dict, fields: dict, log: Path) -> tuple[dict, bytes]:
    """One ``POST /v1/videos/sync`` as a multipart form: its row (where the seconds went) and its MP4."""
    import numpy as np
    import requests

    from ray_hsdp.serve.media import decode_mp4, encode_mp4

    files = {key: (None, json.dumps(value) if isinstance(value, dict) else str(value)) for key, value in fields.items()}
    started = time.perf_counter()
    answer = requests.post(f"{base}/v1/videos/sync", headers=headers, files=files, timeout=1800)
    client_s = time.perf_counter() - started
    answer.raise_for_status()
    frames, _ = decode_mp4(answer.content)
    started = time.perf_counter()
    encode_mp4(np.ascontiguousarray(frames), 16)
    mp4_s = time.perf_counter() - started
    line, deadline = {}, time.monotonic() + 20  # the replica's log reaches the driver's a moment later
    while not line and time.monotonic() < deadline:
        line = request_lines(log).get(answer.headers["X-Video-Id"]) or time.sleep(0.2) or {}
    run_s, step_s = line.get("run_s"), line.get("step_s")
    steps = line.get("steps") or 0
    row = {
        "fields": fields,
        "client_s": round(client_s, 3),
        "inference_time_s": float(answer.headers["X-Inference-Time-S"]),
        "group_run_s": run_s,
        "steps": steps,
        "step_s": _round(step_s),
        "text_encoding_s": _round(line.get("before_loop_s")),
        "steps_s": round(step_s * steps, 3) if step_s is not None else None,
        "decode_and_copy_s": _round(line.get("after_loop_s")),
        "mp4_encoding_s": round(mp4_s, 3),
        "rest_s": round(client_s - run_s - mp4_s, 3) if run_s is not None else None,
        "compiled": line.get("compiled"),
        "mp4_bytes": len(answer.content),
    }
    return row, frames


def _round(seconds: float | None) -> float | None:
    return round(seconds, 3) if seconds is not None else None


def run_served(args) -> dict:
    import numpy as np

    if args.requests < 1:
        raise SystemExit("--requests: at least one few-step request")

    size = {"width": args.width, "height": args.height, "num_frames": args.frames}
    overrides = [f"max_steps={max(args.long_steps, 12)}", *args.set]
    server = ServedYaml(args.config, args.model, overrides, args.out, args.name)
    rows = []
    with server:
        for i in range(args.requests):
            few = {"prompt": PROMPT, **size, "seed": 0}  # the adapter's defaults give the rest
            row, frames = sync_video(server.base, server.headers, few, server.log_path)
            rows.append({"request": f"few-step {i + 1}", **row})
            print(rows[-1], flush=True)
        np.save(args.served_file, frames)
        drift = frames_drift(frames, np.load(args.frames_file)) if args.frames_file.exists() else None
        long = {"prompt": PROMPT, **size, "seed": 0, "num_inference_steps": args.long_steps}
        long |= {"guidance_scale": args.long_guidance, "extra_params": {"sample_solver": "unipc"}}
        row, _ = sync_video(server.base, server.headers, long, server.log_path)
        rows.append({"request": f"{args.long_steps} steps, guidance {args.long_guidance:g}, unipc", **row})
        print(rows[-1], flush=True)
        start = {"ready_s": round(server.ready_s, 1), "group_phases_s": server.phases}
    return {"environment": environment(), "config": str(args.config), "overrides": overrides, "start": start,
            "served": rows, "served_vs_plain_few_step": drift}  # fmt: skip


def frames_drift(served, plain) -> dict:
    """How far the served MP4's frames (uint8) are from plain diffusers' (in [0, 1])."""
    import numpy as np

    from ray_hsdp.serve.media import decode_mp4, encode_mp4, to_uint8

    diff = np.abs(np.asarray(served, dtype=np.float32)[: len(plain)] / 255.0 - plain)
    # What the MP4 alone costs: plain's frames through the same encoder and back.
    round_trip, _ = decode_mp4(encode_mp4(to_uint8(plain), 16))
    mp4 = np.abs(round_trip.astype(np.float32) / 255.0 - plain)
    return {
        "mean_abs": round(float(diff.mean()), 4),
        "max_abs": round(float(diff.max()), 4),
        "mp4_alone_mean_abs": round(float(mp4.mean()), 4),
        "mp4_alone_max_abs": round(float(mp4.max()), 4),
    }


def run_plain(args) -> list[dict]:
    """Plain diffusers: the long request, then the few-step one with the LoRA fused by diffusers."""
    import numpy as np
    import torch

    from bench.common import load_plain
    from bench.reference import solver_as_written, with_sigmas

    pipe = load_plain(Path(args.model), args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    size = {"width": args.width, "height": args.height, "num_frames": args.frames}
    pipe(prompt="warm up", num_inference_steps=1, output_type="latent", **size)

    def timed(**kwargs) -> tuple[float, np.ndarray]:
        sync()
        started = time.perf_counter()
        out = pipe(prompt=PROMPT, generator=torch.Generator("cpu").manual_seed(0), output_type="np", **size, **kwargs)
        sync()
        return time.perf_counter() - started, np.asarray(out.frames[0], dtype=np.float32)

    long_s, _ = timed(num_inference_steps=args.long_steps, guidance_scale=args.long_guidance)
    rows = [{"request": f"{args.long_steps} steps, guidance {args.long_guidance:g}, the folder's scheduler",
             "pipeline_s": round(long_s, 3)}]  # fmt: skip
    started = time.perf_counter()
    pipe.load_lora_weights(args.lora, adapter_name="distill")
    pipe.fuse_lora(lora_scale=1.0, adapter_names=["distill"])
    pipe.unload_lora_weights()
    fuse_s = time.perf_counter() - started
    sigmas = [1.0, 0.75, 0.5, 0.25]
    pipe.scheduler = with_sigmas(solver_as_written(pipe.scheduler, "euler", 5.0), sigmas)
    few_s, frames = timed(num_inference_steps=len(sigmas), guidance_scale=1.0)
    np.save(args.frames_file, frames)
    rows.append({"request": "4 steps (euler, sigmas 1/0.75/0.5/0.25, shift 5), guidance 1, LoRA fused",
                 "pipeline_s": round(few_s, 3), "fuse_s": round(fuse_s, 1)})  # fmt: skip
    if args.served_file.exists():  # the server ran first
        rows[-1]["served_vs_plain"] = frames_drift(np.load(args.served_file), frames)
    return rows


def markdown(results: dict) -> str:
    env = results["environment"]
    head = [
        f"# A few-step config served: `{results['config']}`",
        "",
        f"GPUs: {', '.join(env['gpus']) or 'none'}; torch {env.get('torch')}, diffusers {env.get('diffusers')}.",
        f"Command: `{env['command']}`; overrides: `{' '.join(results['overrides'])}`",
        "",
        f"Server ready (group loaded, warm-up run) {results['start']['ready_s']} s after `serve run`; the group's "
        f"start: {', '.join(f'{k} {v:.1f} s' for k, v in results['start']['group_phases_s'].items())}.",
        "",
        "Synchronous requests (`POST /v1/videos/sync`), one at a time. Seconds:",
        "",
        "| request | client (POST to MP4) | group run | text encoding | steps x step | decode + copy to host |"
        " MP4 encoding | rest (HTTP, queue, store) | compiled |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    rows = [
        f"| {r['request']} | {r['client_s']:.2f} | {r['group_run_s']} | {r['text_encoding_s']} | "
        f"{r['steps']} x {r['step_s']} | {r['decode_and_copy_s']} | {r['mp4_encoding_s']} | {r['rest_s']} | "
        f"{r['compiled']} |"
        for r in results["served"]
    ]
    plain = results.get("plain_diffusers") or []
    tail = ["", "Plain diffusers on the same GPU in the same session (the pipeline call, no HTTP or MP4):", ""]
    for r in plain:
        fused = f" (the LoRA fused in {r['fuse_s']} s)" if "fuse_s" in r else ""
        tail.append(f"- {r['request']}: {r['pipeline_s']:.2f} s{fused}")
    drift = results.get("served_vs_plain_few_step") or (plain[-1].get("served_vs_plain") if plain else None)
    if drift:
        tail.append(f"- the last served few-step MP4's frames vs plain diffusers' few-step frames: mean abs "
                    f"{drift['mean_abs']}, max abs {drift['max_abs']} (in [0, 1]; FP8 and the MP4 included; the MP4 "
                    f"alone, plain's frames encoded and decoded: mean abs {drift['mp4_alone_mean_abs']}, max abs "
                    f"{drift['mp4_alone_max_abs']})")  # fmt: skip
    return "\n".join(head + rows + (tail if plain else [])) + "\n"


def main() -> None:
    args = build_parser().parse_args()
    plain_path, served_path = args.out / f"{args.name}-plain.json", args.out / f"{args.name}.json"
    if args.part == "plain":
        args.out.mkdir(parents=True, exist_ok=True)
        plain_path.write_text(json.dumps({"environment": environment(), "plain_diffusers": run_plain(args)}, indent=1))
        print(plain_path.read_text())
        if not served_path.exists():
            return
    results = run_served(args) if args.part == "serve" else json.loads(served_path.read_text())
    if plain_path.exists():
        results["plain_diffusers"] = json.loads(plain_path.read_text())["plain_diffusers"]
    write_results(args.out, args.name, results, markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
