"""Every deadline of a request comes from one module (``ray_hsdp.deadlines``)."""

from __future__ import annotations

import time

from ray_hsdp import deadlines
from ray_hsdp.config.group import GroupConfig
from ray_hsdp.request import GenerationRequest

CONFIG = GroupConfig(model="tiny", queue_timeout_s=100.0, request_timeout_s=30.0)


def test_the_queue_deadline_is_kept_from_arrival_unless_the_request_ran():
    before = time.time()
    arrived = GenerationRequest(prompt="p", queue_deadline=deadlines.from_arrival(CONFIG))
    assert before + 100.0 <= arrived.queue_deadline <= time.time() + 100.0
    assert deadlines.queue_deadline(arrived, CONFIG) == arrived.queue_deadline  # kept wherever it waits
    never_served = GenerationRequest(prompt="p")  # a group driven directly: its own, from now
    assert deadlines.queue_deadline(never_served, CONFIG) >= before + 100.0
    early = GenerationRequest(prompt="p", queue_deadline=before - 5.0)
    assert deadlines.waits_anew(early, CONFIG).queue_deadline >= before + 100.0  # it ran: a wait of its own


def test_the_run_deadline_is_the_request_s_or_the_group_s():
    assert deadlines.run_timeout(GenerationRequest(prompt="p", timeout_s=2.0), CONFIG) == 2.0
    assert deadlines.run_timeout(GenerationRequest(prompt="p"), CONFIG) == 30.0
