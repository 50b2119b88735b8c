"""``POST /v1/chat/completions`` for an image or video model, as vllm-omni answers it: the prompt is
the last user message's text (an image part of it is the request's ``input_reference``), the
generation fields come at the top level (the OpenAI SDK's ``extra_body`` merges them there) or
under a JSON ``"extra_body"`` key (what vllm-omni's curl examples send), and the answer is one
assistant message whose content parts carry the image(s) or the MP4 as data URLs.

A chat request runs as the same request would on ``/v1/images/generations`` or
``/v1/videos/sync``: the same fields, limits and refusals (a field the route does not take is a
400 that names it)."""

from __future__ import annotations

import base64
import time
import uuid
from dataclasses import dataclass

from ray_hsdp.serve.errors import RequestLimitError

#: Chat fields an image or video model has no use for, accepted and dropped: OpenAI's end-user id.
DROPPED = ("user",)


@dataclass(frozen=True)
class ChatAsk:
    """What a chat request asks of a diffusion model.

    Attributes:
        model: The model it names (``None``: the endpoint's only one).
        prompt: The last user message's text.
        fields: Its generation fields (the top level's and ``extra_body``'s together).
        image: An image part of the last user message, as its data URL (``input_reference``).
    """

    model: str | None
    prompt: str
    fields: dict
    image: str | None = None

    def video_body(self) -> dict:
        """The body of ``POST /v1/videos/sync`` that runs it."""
        return self._body(self.fields)

    def image_body(self) -> dict:
        """The body of ``POST /v1/images/generations`` that runs it: vllm-omni's ``width`` and
        ``height`` as our ``size`` (both or neither, agreeing with a ``size`` given too)."""
        fields = dict(self.fields)
        width, height = fields.pop("width", None), fields.pop("height", None)
        if (width is None) != (height is None):
            raise RequestLimitError("width and height go together: give both, or neither (or size)")
        if width is not None:
            size = f"{width}x{height}"
            if fields.get("size", size) != size:
                raise RequestLimitError(f"size={fields['size']!r} and width x height = {size} disagree: give one")
            fields["size"] = size
        return self._body(fields)

    def _body(self, fields: dict) -> dict:
        body = {**fields, "prompt": self.prompt}
        if self.model is not None:
            body["model"] = self.model
        if self.image is not None:
            if "input_reference" in fields:
                raise RequestLimitError("the image is given twice: as a message part and as input_reference")
            body["input_reference"] = self.image
        return body


def read_chat(body) -> ChatAsk:
    """The ask of a chat request's JSON body.

    Raises:
        RequestLimitError: No messages, no user message with text, a content part that is neither
            text nor an image, ``stream``, or a field given at the top level and in ``extra_body``
            with different values.
    """
    if not isinstance(body, dict):
        raise RequestLimitError("the body must be a JSON object")
    fields = dict(body)
    nested = fields.pop("extra_body", None) or {}
    if not isinstance(nested, dict):
        raise RequestLimitError("extra_body must be a JSON object of generation fields")
    for key in set(fields) & set(nested):
        if fields[key] != nested[key]:
            raise RequestLimitError(f"{key} is given at the top level and in extra_body with different values")
    fields.update(nested)
    if fields.pop("stream", False):
        raise RequestLimitError("stream: an image or a video comes whole; send stream false (or leave it out)")
    for key in DROPPED:
        fields.pop(key, None)
    model = fields.pop("model", None)
    prompt, image = _last_user_message(fields.pop("messages", None))
    return ChatAsk(model, prompt, fields, image)


def _last_user_message(messages) -> tuple[str, str | None]:
    """The text of the last user message, and the data URL of an image part of it."""
    if not isinstance(messages, list) or not messages:
        raise RequestLimitError("messages must be a non-empty list of {role, content}")
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        raise RequestLimitError("messages has no user message: the prompt is the last user message's text")
    content = users[-1].get("content")
    if isinstance(content, str):
        return content, None
    if not isinstance(content, list):
        raise RequestLimitError("a message's content must be text or a list of content parts")
    texts, images = [], []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            texts.append(str(part.get("text", "")))
        elif kind == "image_url":
            url = part.get("image_url")
            images.append(url.get("url") if isinstance(url, dict) else url)
        else:
            raise RequestLimitError(f"a content part of type {kind!r}: this model takes text and image_url parts")
    if len(images) > 1:
        raise RequestLimitError(f"the last user message has {len(images)} images; a request takes one")
    return "\n".join(texts), (images[0] if images else None)


def _answer(model: str, parts: list[dict], extra: dict) -> dict:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": parts}}],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        **extra,
    }


def video_answer(model: str, out: dict) -> dict:
    """The chat answer of a sync video (``generate_video``'s ``{"video", "mp4"}``): its MP4 as a
    ``video_url`` part, and the video object (our extension, as ``video``)."""
    url = "data:video/mp4;base64," + base64.b64encode(out["mp4"]).decode("ascii")
    return _answer(model, [{"type": "video_url", "video_url": {"url": url}}], {"video": out["video"]})


def image_answer(model: str, answer: dict) -> dict:
    """The chat answer of an images response: each image as an ``image_url`` part, and the seed."""
    media = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}[answer.get("output_format", "png")]
    parts = [
        {"type": "image_url", "image_url": {"url": f"data:{media};base64,{item['b64_json']}"}}
        for item in answer["data"]
    ]
    return _answer(model, parts, {"seed": answer.get("seed")})
