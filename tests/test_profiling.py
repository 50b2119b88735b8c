"""Profiling is a seam of the runtime: a window opened and closed while the tick thread runs."""

from support import wait_until

from ray_hsdp.config.group import GroupConfig
from ray_hsdp.group import ShardGroup
from ray_hsdp.request import GenerationRequest


def test_a_profile_stopped_while_a_request_ticks_reports_ticks_and_steps(ray_cluster, tiny_model):
    with ShardGroup(GroupConfig(model=tiny_model, device="cpu", shard_size=2)) as group:
        group.start_profile()
        request = GenerationRequest(prompt="profiled", num_inference_steps=80, width=96, request_id="p")
        future = group.submit(request)
        wait_until(lambda: group.progress().get("p", {}).get("step", 0) >= 5, what="step 5")
        summaries = group.stop_profile()  # the tick thread keeps ticking meanwhile
        assert future.result(timeout=120).frames.shape == (1, 1, 64, 96, 3)
        group.start_profile()  # a second window on the same ranks
        (again,) = group.generate([GenerationRequest(prompt="again", request_id="q")])
        second = group.stop_profile()
    runs, watches = summaries  # rank 0 runs the lone request, rank 1 ghosts its forwards
    assert runs["ticks"]["own"]["ticks"] >= 5 and runs["ticks"]["own"]["with_forward"] >= 5
    assert watches["ticks"]["idle"]["ticks"] >= 5
    assert len(runs["requests"]["p"]["steps"]) >= 5 and "end" not in runs["requests"]["p"]
    assert "end" in second[0]["requests"]["q"]
