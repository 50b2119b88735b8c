"""No server answers strangers unless its config says so (issue 55): a replica that finds no API key
refuses to start where Serve's HTTP host is not a loopback address, and says every way to give one."""

from __future__ import annotations

import pytest

from ray_hsdp.config import AppConfig
from ray_hsdp.serve.ingress import refuse_keyless

CONFIG = AppConfig(model="tiny", device="cpu")


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.1.1", "localhost", "::1"])
def test_a_keyless_replica_serves_on_a_loopback_host(host):
    refuse_keyless(None, CONFIG, host)


@pytest.mark.parametrize("host", ["0.0.0.0", "198.51.100.7", "::", None])
def test_a_keyless_replica_refuses_a_host_strangers_reach_naming_every_way_to_give_a_key(host):
    with pytest.raises(ValueError) as refused:
        refuse_keyless(None, CONFIG, host)
    message = str(refused.value)
    for way in ("RAY_HSDP_API_KEY", "api_key_file", "ray-hsdp serve", "127.0.0.1", "allow_unauthenticated: true"):
        assert way in message, (way, message)
    refuse_keyless("a key", CONFIG, host)  # with a key it serves
    refuse_keyless(None, CONFIG.model_copy(update={"allow_unauthenticated": True}), host)  # or when told to
