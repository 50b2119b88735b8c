"""A forward batches only calls of one batch key (their requests' LoRA adapters, from their
variants): requests with different adapters on one rank never share a forward, and requests with
the same ones still do."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ray_hsdp.runtime import ForwardCall, RankRuntime


@dataclass(frozen=True)
class Request:
    request_id: str
    lora: tuple
    num_inference_steps: int = 4

    @property
    def batch_key(self):
        return self.lora


class RecordingModules:
    """One module; each forward records the variants of the calls it ran together."""

    names = ("transformer",)

    def __init__(self):
        self.batches: list[list] = []

    def before_call(self, call: ForwardCall) -> None:
        pass

    def after_call(self, call: ForwardCall) -> None:
        pass

    def forward(self, calls: list[ForwardCall]) -> list:
        self.batches.append([c.batch_key for c in calls])
        return [c.args[0] + 1 for c in calls]

    def ghost(self, module_id: int) -> None:
        raise AssertionError("one rank never ghosts")


def test_calls_of_different_adapters_never_share_a_forward():
    modules = RecordingModules()
    holder = {}

    def run_request(request, on_step):
        for step in range(request.num_inference_steps):
            holder["runtime"].call(0, (torch.zeros(1),), {})
            on_step(step + 1, request.num_inference_steps)
        return request.request_id

    runtime = RankRuntime(
        run_request,
        slots=4,
        modules=modules,
        exchange=lambda state: [state],
        patience_s=0.05,  # time for all four threads' calls to wait together
        max_batch=4,
    )
    holder["runtime"] = runtime
    style, detail = (("style", 1.0),), (("detail", 0.5),)
    jobs = [runtime.submit(Request(f"r{i}", lora)) for i, lora in enumerate([style, detail, style, ()])]
    runtime.session()
    assert [job.get() for job in jobs] == ["r0", "r1", "r2", "r3"]
    assert all(len(set(batch)) == 1 for batch in modules.batches), modules.batches
    assert any(batch == [style, style] for batch in modules.batches), modules.batches  # the same ones batch
    assert sum(len(batch) for batch in modules.batches) == 16
