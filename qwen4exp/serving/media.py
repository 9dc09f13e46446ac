"""Media URLs in chat requests: the ``qwen4exp`` media connector (``VLLM_MEDIA_CONNECTOR=qwen4exp``; ``qwen4exp-serve``
selects it unless ``VLLM_MEDIA_CONNECTOR`` is set).

vLLM's own connector (``http``) fetches every http(s) URL a request names, from the API server: on a machine without
network that is a 500 after a DNS failure or a timeout, and on one with network the server fetches whatever a client
points it at. This one keeps vLLM's loaders and changes what is refused, before any I/O:
* ``data:`` URLs (``data:image/png;base64,...``) are decoded by vLLM's loaders; a payload that is not base64, or bytes
  that are not an image, get a 400 naming the content part (``image_url``) and the problem;
* http(s) URLs get a 400 saying that remote URLs are not fetched and to send a data URL; no connection is made.
  With ``--allowed-media-domains HOST ...`` the server fetches from those hosts (vLLM's connector, its checks);
* ``file:`` URLs get a 400 unless the server was started with ``--allowed-local-media-path DIR`` (vLLM answers 500).
"""

from __future__ import annotations

import binascii
import re

from urllib3.util import parse_url
from vllm.exceptions import VLLMClientError, VLLMValidationError
from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY, MediaConnector

_FIELDS = {"ImageMediaIO": ("image_url", "an image"), "VideoMediaIO": ("video_url", "a video"),
           "AudioMediaIO": ("audio_url", "audio")}


def _field(media_io) -> tuple[str, str]:
    """(the OpenAI content part's field, what it should hold) for a vLLM media loader."""
    return _FIELDS.get(type(media_io).__name__, ("media url", "media"))


def refusal(url: str, field: str, *, domains: list[str], local_path) -> str | None:
    """Why a ``field`` URL is refused before any I/O, or None (data URLs; http(s) with ``--allowed-media-domains``;
    file with ``--allowed-local-media-path``: vLLM's checks apply)."""
    if url[:5].lower() == "data:":
        return None
    try:
        spec = parse_url(url)
    except Exception:
        return f"{field}: not a valid URL; send the content inline as a base64 data URL (data:image/png;base64,...)"
    scheme = (spec.scheme or "").lower()
    if scheme in ("http", "https") and not domains:
        return (f"{field}: remote URLs ({scheme}://{spec.netloc or ''}/...) are not fetched by this server (it may "
                f"have no network); send the content inline as a base64 data URL, e.g. "
                f"data:image/png;base64,<base64 of the PNG bytes>")
    if scheme == "file" and local_path is None:
        return (f"{field}: file URLs are not read by this server (it was started without "
                f"--allowed-local-media-path); send the content inline as a base64 data URL")
    return None


def data_url_error(field: str, what: str, e: Exception) -> VLLMValidationError:
    """A data URL vLLM's loader failed on, as a 400 naming the field and the problem."""
    if isinstance(e, binascii.Error):
        msg = f"{field}: the data URL's payload is not valid base64 ({e})"
    elif isinstance(e, NotImplementedError):  # e.g. data:image/png,<raw> (not base64)
        msg = f"{field}: only base64 data URLs are read (data:<media type>;base64,<data>)"
    elif str(e).startswith("Invalid data URL"):  # no ',' after the header
        msg = f"{field}: not a valid data URL (data:<media type>;base64,<data>): no ',' before the data"
    else:
        detail = re.sub(r"\s*<[^<>]* object at 0x[0-9a-f]+>|\s*<_io\.\w+ object>", "", str(e)).strip()
        if detail.startswith("Failed to load image: "):
            detail = detail[len("Failed to load image: "):]
        msg = f"{field}: the data URL does not hold {what} this server can read ({detail})"
    return VLLMValidationError(msg, parameter=field)


class LocalMediaConnector(MediaConnector):
    """vLLM's ``MediaConnector`` that refuses remote (and, by default, local file) URLs before any I/O and names the
    problem of a data URL it cannot decode."""

    def _check(self, url: str, media_io) -> tuple[str, str]:
        field, what = _field(media_io)
        why = refusal(url, field, domains=self.allowed_media_domains, local_path=self.allowed_local_media_path)
        if why is not None:
            raise VLLMValidationError(why, parameter=field)
        return field, what

    def load_from_url(self, url, media_io, *, fetch_timeout=None):
        field, what = self._check(url, media_io)
        try:
            return super().load_from_url(url, media_io, fetch_timeout=fetch_timeout)
        except VLLMClientError:
            raise
        except Exception as e:
            if url[:5].lower() != "data:":
                raise  # (vLLM's fetch errors, with --allowed-media-domains / --allowed-local-media-path)
            raise data_url_error(field, what, e) from e

    async def load_from_url_async(self, url, media_io, *, fetch_timeout=None):
        field, what = self._check(url, media_io)
        try:
            return await super().load_from_url_async(url, media_io, fetch_timeout=fetch_timeout)
        except VLLMClientError:
            raise
        except Exception as e:
            if url[:5].lower() != "data:":
                raise  # (vLLM's fetch errors, with --allowed-media-domains / --allowed-local-media-path)
            raise data_url_error(field, what, e) from e


def register(name: str) -> None:
    """Make ``LocalMediaConnector`` vLLM's media connector ``name`` (the model binding's ``register()`` calls this
    with its ``MEDIA_CONNECTOR`` where ``VLLM_MEDIA_CONNECTOR`` selects it; this module imports nothing of the
    binding)."""
    MEDIA_CONNECTOR_REGISTRY.register(name)(LocalMediaConnector)
