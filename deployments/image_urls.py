"""Image URLs of chat content parts -> encoded image bytes.

`data:` URLs (base64, an image media type) always; `http(s)` URLs only when the deployment
enables fetching, within a timeout and the size cap, following redirects only to http(s); any
other scheme (file paths included) never. Failures raise `ImageError` (a client error).
"""

from __future__ import annotations

import base64
import binascii
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from .images import ImageError

FETCHED_SCHEMES = ("http", "https")


def image_bytes(url: str, max_bytes: int, fetch: bool, timeout_s: float) -> bytes:
    scheme = urlsplit(url).scheme.lower()
    if scheme == "data":
        return _data_url(url, max_bytes)
    if scheme in FETCHED_SCHEMES:
        if not fetch:
            raise ImageError("this server does not fetch image URLs; send the image inline "
                             "as a data: URL (data:image/png;base64,...)")
        return _fetch(url, max_bytes, timeout_s)
    raise ImageError(f"unsupported image URL scheme {scheme or '(none)'!r}: use a data: URL"
                     + (" or http(s)" if fetch else ""))


def _data_url(url: str, max_bytes: int) -> bytes:
    header, sep, payload = url[len("data:"):].partition(",")
    media_type, *params = header.split(";")
    if not sep or "base64" not in params:
        raise ImageError("a data: image URL must be base64: data:image/<type>;base64,<data>")
    if not media_type.lower().startswith("image/"):
        raise ImageError(f"a data: URL of media type {media_type or '(none)'!r} is not an "
                         "image")
    if len(payload) * 3 // 4 > max_bytes + 2:  # refuse before decoding
        raise ImageError(f"an image is larger than {max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data: URL is not valid base64") from None


class _HTTPOnlyRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urlsplit(newurl).scheme.lower() not in FETCHED_SCHEMES:
            raise ImageError("an image URL redirected away from http(s)")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = urllib.request.build_opener(_HTTPOnlyRedirects())


def _fetch(url: str, max_bytes: int, timeout_s: float) -> bytes:
    try:
        with _OPENER.open(urllib.request.Request(url, headers={"Accept": "image/*"}),
                          timeout=timeout_s) as response:
            data = response.read(max_bytes + 1)
    except ImageError:
        raise
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ImageError(f"cannot fetch the image URL: {exc}") from None
    if len(data) > max_bytes:
        raise ImageError(f"an image is larger than {max_bytes} bytes")
    return data
