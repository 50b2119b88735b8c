"""The first frame of an image-to-video request (``image``): required by an image-to-video
pipeline, refused by a text one (a pair of the table of refusals, ``ray_hsdp.config.pairs``)."""

from __future__ import annotations

from ray_hsdp.request import InvalidRequestError
from ray_hsdp.variant.base import Feature


class FirstFrame(Feature):
    field = "image"

    def choose(self, request, config, facts):
        if facts.get("image_input") and request.image is None:
            raise InvalidRequestError(
                f"{config.served_model_name} makes a video from an image: send the first frame (input_reference)"
            )
        return request.image

    def pipeline_kwargs(self, choice) -> dict:
        import io

        from PIL import Image

        return {"image": Image.open(io.BytesIO(choice)).convert("RGB")}
