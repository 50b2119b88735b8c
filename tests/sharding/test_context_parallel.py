"""Attention backends on a model: which attentions a backend reaches."""

import pytest
import torch
from diffusers.models.attention_dispatch import attention_backend
from test_policies_models import _wan

from ray_hsdp.sharding.context_parallel import keep_cross_attention_native, set_attention_backend


@pytest.fixture(autouse=True)
def _process_backend_kept():
    # diffusers' set_attention_backend also sets the process's active backend, which every later
    # model without one of its own would use: the context manager puts it back.
    with attention_backend("native"):
        yield


def _backends(model) -> dict[str, str]:
    return {
        name: str(getattr(module.processor._attention_backend, "value", module.processor._attention_backend))
        for name, module in model.named_modules()
        if name.endswith(("attn1", "attn2"))
    }


def test_cross_attentions_keep_torch_sdpa_and_the_self_attentions_take_the_backend():
    # A backend that quantizes V per channel (sage) would make NaN from a text key set with an
    # all-zero channel; CPU has no sage, so the routing is checked with the math kernel in its place.
    model, inputs = _wan()
    model.set_attention_backend("_native_math")
    before = model(**inputs, return_dict=False)[0]
    assert keep_cross_attention_native(model) == len(model.blocks)
    backends = _backends(model)
    assert {name: b for name, b in backends.items() if name.endswith("attn2")} == {
        f"blocks.{i}.attn2": "native" for i in range(len(model.blocks))
    }
    assert {b for name, b in backends.items() if name.endswith("attn1")} == {"_native_math"}
    torch.testing.assert_close(model(**inputs, return_dict=False)[0], before)


def test_a_backend_that_keeps_v_exact_reaches_every_attention():
    model, _ = _wan()
    set_attention_backend(model, "_native_math")
    assert set(_backends(model).values()) == {"_native_math"}
