"""Images in chat requests to a VL checkpoint (Ling-3.0-flash-VL): OpenAI's `image_url` content parts.

An `image_url` part's `url` is a `data:` URL (`data:image/png;base64,...`: PNG, JPEG or any image Pillow reads)
or, only when the server runs with `--allowed-local-media-path DIR`, a local file inside DIR (a `file://` URL, an
absolute path, or a path relative to DIR). Nothing is fetched from the network: an http(s) URL is refused.

Each image part becomes the `<image>` placeholder in its message's text, the messages go through the chat
template as text, and the rendered prompt is tokenised with each placeholder replaced by [vision_start, image
pad x N, vision_end] (`ling_jax.vl.prompt`): the prompt `generate.py --chat --image` builds for the same text
and image. The images' patches and grids go with the request (`MediaInputs`, one row) to the engine, which runs
the vision tower when it admits the request. Bad input is a 400 naming the part (`messages.0.content.1...`).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import os
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
from PIL import Image

from ling_jax.generation.generator import MediaInputs
from ling_jax.generation.tokenizer import Tokenizer
from ling_jax.mrope import MediaGrid
from ling_jax.serving.schemas import APIError, ChatMessage
from ling_jax.vl.config import LingVLConfig
from ling_jax.vl.image_processing import ProcessorConfig, preprocess_image
from ling_jax.vl.prompt import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, PromptMedia, encode_with_media, media_inputs

LOCAL_MEDIA_FLAG = "--allowed-local-media-path"
IMAGE_URL_KEYS = frozenset({"url", "detail"})  # `detail` (OpenAI's resolution hint) is accepted and ignored

Patches = tuple[np.ndarray, MediaGrid]  # one preprocessed image: its patches [N, patch_dim] and grid


@dataclasses.dataclass(frozen=True)
class MediaReader:
    """What a VL server reads images with: the model's VL config, the checkpoint's image processor and the
    directory local files may come from (None: no local files)."""

    vl_config: LingVLConfig
    processor: ProcessorConfig
    local_dir: Path | None = None

    @classmethod
    def for_checkpoint(cls, path: str | os.PathLike, vl_config: LingVLConfig, local_dir: Path | None) -> MediaReader:
        """The checkpoint's preprocessor_config.json (or the defaults); local_dir must be a directory."""
        if local_dir is not None and not local_dir.is_dir():
            raise ValueError(f"{LOCAL_MEDIA_FLAG} {local_dir}: not a directory")
        processor = ProcessorConfig.from_pretrained(path, vl_config.vision)
        return cls(vl_config, processor, None if local_dir is None else local_dir.resolve())

    def image(self, url: str, where: str) -> Patches:
        """The image at `url` (the part at `where`), preprocessed; 400 for a URL it may not or cannot read."""
        source = self._source(url, where)
        try:
            with Image.open(source) as image:
                image.load()
        except (OSError, Image.DecompressionBombError) as e:
            raise _refused(where, f"not an image Pillow can read ({e})") from e
        try:
            return preprocess_image(image, self.processor)
        except ValueError as e:  # an aspect ratio the processor refuses
            raise _refused(where, str(e)) from e

    def _source(self, url: str, where: str) -> io.BytesIO | Path:
        if url.startswith("data:"):
            header, comma, payload = url.partition(",")
            if not comma or not header.startswith("data:image/") or not header.endswith(";base64"):
                raise _refused(where, "a data: URL must read data:image/<type>;base64,<data>")
            try:
                return io.BytesIO(base64.b64decode(payload, validate=True))
            except binascii.Error as e:
                raise _refused(where, f"the data: URL's payload is not valid base64 ({e})") from e
        parts = urllib.parse.urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme in ("http", "https"):
            raise _refused(where, "ling-serve never fetches media from the network; send the image as a data: URL")
        if scheme not in ("", "file"):
            raise _refused(where, f"unsupported URL scheme {scheme!r} (data: URLs, and local files with the flag)")
        if self.local_dir is None:
            raise _refused(where, f"local files are refused: start ling-serve with {LOCAL_MEDIA_FLAG} DIR")
        path = Path(urllib.request.url2pathname(parts.path) if scheme == "file" else url)
        resolved = (self.local_dir / path).resolve()  # an absolute path stays itself
        if not resolved.is_relative_to(self.local_dir):
            raise _refused(where, f"{path} is outside {LOCAL_MEDIA_FLAG} {self.local_dir}")
        if not resolved.is_file():
            raise _refused(where, f"{path}: no such file")
        return resolved


def _refused(where: str, why: str) -> APIError:
    return APIError(400, f"{where}: {why}", param="messages")


def split_images(messages: list[ChatMessage], reader: MediaReader | None) -> tuple[list[ChatMessage], list[Patches]]:
    """The messages with each `image_url` part made the `<image>` placeholder text, and the images in order;
    400 for an image on a text model (reader None) and for a content part neither text nor image_url."""
    images: list[Patches] = []
    placed = []
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            placed.append(message)
            continue
        parts = []
        for j, part in enumerate(message.content):
            where = f"messages.{i}.content.{j}"
            kind = part.get("type")
            if kind == "text":
                parts.append(part)
                continue
            if kind != "image_url":
                raise APIError(
                    400, f"{where}: content part type {kind!r} is not supported (text; image_url)", param="messages"
                )
            if reader is None:
                raise _refused(where, "image_url parts need a VL checkpoint; this server's model is a text model")
            image_url = part.get("image_url")
            if not isinstance(image_url, dict) or not isinstance(image_url.get("url"), str):
                raise _refused(where, 'an image_url part needs "image_url": {"url": "data:image/...;base64,..."}')
            unknown = sorted(set(image_url) - IMAGE_URL_KEYS)
            if unknown:
                raise _refused(where, f"unsupported field `image_url.{unknown[0]}`")
            images.append(reader.image(image_url["url"], where + ".image_url.url"))
            parts.append({"type": "text", "text": IMAGE_PLACEHOLDER})
        placed.append(message.model_copy(update={"content": parts}))
    return placed, images


def encode_with_images(
    tokenizer: Tokenizer, text: str, images: list[Patches], reader: MediaReader | None
) -> tuple[list[int], MediaInputs | None]:
    """A rendered chat prompt's ids (each `<image>` placeholder an image's block) and its images as one row of
    `MediaInputs` (None without images)."""
    if not images:
        return tokenizer.encode(text, add_special_tokens=False), None
    if text.count(IMAGE_PLACEHOLDER) != len(images) or VIDEO_PLACEHOLDER in text:
        raise APIError(
            400,
            f"messages: with image parts the text may not itself hold {IMAGE_PLACEHOLDER} or {VIDEO_PLACEHOLDER} "
            "(the prompt marks each image with it)",
            param="messages",
        )
    media = PromptMedia(images=tuple(images))
    ids = encode_with_media(
        lambda piece, _first: tokenizer.encode(piece, add_special_tokens=False), text, media, reader.vl_config
    )
    return ids, media_inputs(media, 1)
