"""Image inputs: a chat content part (or an offline caller's image) -> a decoded PIL image.

What a request may name, as OpenAI and vLLM take it:

    {"type": "image_url", "image_url": {"url": URL, "detail": ...}}   OpenAI's part
    {"image_url": URL}                                                vLLM's short form
    a PIL image, or a path (os.PathLike)                              the offline API

and the URLs, each behind the limits of one `MediaPolicy`:

    data:image/<type>;base64,<strict base64>   always
    file:///path                               only under allowed_local_media_path
    http://, https://                          only when allow_http, and only to a host
                                               of allowed_domains ("*": any), redirects
                                               too (`fetch_http`)

Invariants:
- Every failure is an `ImageInputError` (a ValueError) whose message starts "image_url: "
  and says what was wrong, fit for a 400; Pillow's own errors and its
  DecompressionBombWarning / Error never leave this module as anything else.
- No image is decoded before its header's size is checked against max_pixels, and no
  source is read past max_bytes by more than one 64 KiB chunk.
- Everything here blocks (file reads, the HTTP fetch, decoding): callers on an event loop
  run it on a thread pool.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import http.client
import io
import math
import os
import re
import socket
import stat
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit

from PIL import Image, UnidentifiedImageError

# NOTE: what Pillow may try, not everything it knows: OpenAI's formats plus BMP and TIFF.
# This keeps exotic decoders (EPS runs Ghostscript, ICNS, FITS...) off untrusted bytes.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # JPEG includes MPO
LOCAL_MEDIA_FLAG = "--allowed-local-media-path"
MEDIA_DOMAINS_FLAG = "--allowed-media-domains"
ANY_DOMAIN = "*"
MAX_REDIRECTS = 5
_READ_CHUNK_BYTES = 1 << 16
_REDIRECT_STATUSES = (301, 302, 303, 307, 308)
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*")  # RFC 3986


class ImageInputError(ValueError):
    """An image input that cannot be used; the message is for the client."""

    def __init__(self, message: str) -> None:
        super().__init__(f"image_url: {message}")


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from and how big they may be."""

    allowed_local_media_path: str | None = None  # a folder; None: no local files
    allow_http: bool = False
    allowed_domains: tuple[str, ...] = (ANY_DOMAIN,)  # hosts http(s) URLs may name
    max_bytes: int = 20 << 20  # of the encoded image, from any source
    max_pixels: int = 1 << 25  # width x height, checked before decoding
    fetch_timeout_s: float = 5.0  # the whole HTTP fetch, redirects included

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ValueError(f"max_bytes must be at least 1 byte, got {self.max_bytes}")
        if self.max_pixels < 1:
            raise ValueError(f"max_pixels must be at least 1 pixel, got {self.max_pixels}")
        pillow_limit = Image.MAX_IMAGE_PIXELS
        if pillow_limit is not None and self.max_pixels > pillow_limit:
            # Past it Pillow refuses inside Image.open, before our check could speak.
            raise ValueError(
                f"max_pixels must be at most Pillow's limit of {pillow_limit} pixels, "
                f"got {self.max_pixels}"
            )
        if not self.fetch_timeout_s > 0:
            raise ValueError(f"fetch_timeout_s must be above 0 s, got {self.fetch_timeout_s}")
        path = self.allowed_local_media_path
        if path is not None and not Path(path).is_dir():
            raise ValueError(f"{LOCAL_MEDIA_FLAG}: {path!r} is not a folder")
        hosts = tuple(host.strip().lower() for host in self.allowed_domains)
        if self.allow_http and not all(hosts):
            raise ValueError(f"{MEDIA_DOMAINS_FLAG}: an empty host name in {self.allowed_domains}")
        object.__setattr__(self, "allowed_domains", hosts)

    def allows_host(self, host: str | None) -> bool:
        """Whether an http(s) URL may name `host` (exact names, as vLLM matches them)."""
        if not self.allow_http or not host:
            return False
        return ANY_DOMAIN in self.allowed_domains or host.lower() in self.allowed_domains


def image_from_content_part(
    part: Mapping[str, Any] | Image.Image, policy: MediaPolicy, load: bool = True
) -> Image.Image:
    """The decoded image an image content part names (or a PIL image, checked); `load`
    False: opened and its size checked, its pixels left to `load_pixels`."""
    if isinstance(part, Image.Image):
        return load_image(part, policy, load)
    if not isinstance(part, Mapping):
        raise ImageInputError(f"a content part must be an object, got {type(part).__name__}")
    kind = part.get("type", "image_url")
    if kind != "image_url":
        raise ImageInputError(f"content part type {kind!r} is not an image_url part")
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, Mapping) else image_url
    if not isinstance(url, str) or not url:
        raise ImageInputError("expected {'image_url': {'url': '<URL>'}} with a non-empty URL")
    return load_image(url, policy, load)


def load_image(
    source: str | os.PathLike | Image.Image, policy: MediaPolicy, load: bool = True
) -> Image.Image:
    """A URL, a local path or a PIL image -> a loaded PIL image within the policy (`load`
    False: as `image_from_content_part`)."""
    if isinstance(source, Image.Image):
        check_pixels(source.size, policy)
        return load_pixels(source) if load else source
    if isinstance(source, os.PathLike):
        return decode_image(read_local_file(os.fspath(source), policy), policy, load)
    return decode_image(read_url(source, policy), policy, load)


def read_url(url: str, policy: MediaPolicy) -> bytes:
    """The encoded image bytes a URL names."""
    scheme, colon, _ = url.partition(":")
    scheme = scheme.lower()
    if not colon or not _SCHEME.fullmatch(scheme):
        raise ImageInputError(f"{_shown(url)} is not a URL; use a data:, file: or http(s): URL")
    if scheme == "data":
        return decode_data_url(url, policy)
    if scheme == "file":
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise ImageInputError(f"file URL host {parts.netloc!r} is not this machine")
        return read_local_file(unquote(parts.path), policy)
    if scheme in ("http", "https"):
        if not policy.allow_http:
            raise ImageInputError(
                f"{scheme} URLs are not allowed on this server (start it with "
                f"{MEDIA_DOMAINS_FLAG} HOSTS to fetch images from HOSTS)"
            )
        return fetch_http(url, policy)
    raise ImageInputError(f"URL scheme {scheme!r} is not supported; use data:, file: or http(s):")


def decode_data_url(url: str, policy: MediaPolicy) -> bytes:
    """`data:image/<type>;base64,<payload>` -> the bytes; strict base64 only."""
    header, comma, payload = url[len("data:") :].partition(",")
    if not comma:
        raise ImageInputError("a data URL needs a ',' between its header and its data")
    params = [p.strip().lower() for p in header.split(";")]
    if len(params) < 2 or params[-1] != "base64":
        raise ImageInputError("only base64 data URLs are supported (data:image/png;base64,...)")
    mime = params[0]
    if not mime.startswith("image/") or mime == "image/":
        raise ImageInputError(f"data URL type {mime!r} is not an image type (image/png, ...)")
    if len(payload) > 4 * math.ceil(policy.max_bytes / 3):
        raise ImageInputError(
            f"the data URL holds about {len(payload) * 3 // 4} bytes, past the limit of "
            f"{policy.max_bytes} bytes"
        )
    try:
        data = base64.b64decode(payload, validate=True)
    except binascii.Error as exc:
        raise ImageInputError(f"the data URL's base64 is not valid ({exc})") from None
    _check_bytes(len(data), policy, "the data URL")
    return data


def read_local_file(path_text: str, policy: MediaPolicy) -> bytes:
    """A file under allowed_local_media_path (symlinks and '..' resolved first).

    NOTE: the resolved path is checked, then opened through real folders only
    (`_open_beneath`): a folder swapped for a link between the check and the open (by
    someone who can write under the folder) makes the open fail, instead of reading the
    file the link leads to outside. The bytes are read from the opened descriptor.
    """
    if policy.allowed_local_media_path is None:
        raise ImageInputError(
            f"local files are not allowed on this server (start it with {LOCAL_MEDIA_FLAG} "
            "DIR to allow files under DIR)"
        )
    root = Path(policy.allowed_local_media_path).resolve()
    try:
        resolved = Path(path_text).resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # a link loop, a NUL byte
        raise ImageInputError(f"cannot resolve {path_text!r} ({exc})") from None
    if not resolved.is_relative_to(root):
        raise ImageInputError(f"{path_text!r} is outside the folder {LOCAL_MEDIA_FLAG} allows")
    fd = _open_beneath(root, resolved.relative_to(root).parts, repr(path_text))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ImageInputError(f"{path_text!r} is not a regular file")
        _check_bytes(info.st_size, policy, repr(path_text))
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as file:
        data = file.read(policy.max_bytes + 1)  # the file may have grown since fstat
    _check_bytes(len(data), policy, repr(path_text), exact=False)
    return data


def _open_beneath(root: Path, parts: tuple[str, ...], shown: str) -> int:
    """The file root/parts[0]/.../parts[-1], opened one component at a time, each relative
    to the folder before it and none followed if it is a link (O_NOFOLLOW): what opens
    lies beneath `root` now, whatever the path looked like when it was checked."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise ImageInputError(f"cannot open the folder of {shown}: {exc.strerror}") from None
    try:
        for i, name in enumerate(parts):
            # O_NONBLOCK: a FIFO must not hang the open; the caller's fstat refuses it.
            kind = os.O_NONBLOCK if i == len(parts) - 1 else os.O_DIRECTORY
            try:
                next_fd = os.open(
                    name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | kind, dir_fd=fd
                )
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(name, fd):
                    raise ImageInputError(
                        f"{shown} changed while it was opened (a symbolic link in its path "
                        "now): refused"
                    ) from None
                raise ImageInputError(f"cannot open {shown}: {exc.strerror}") from None
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def fetch_http(url: str, policy: MediaPolicy) -> bytes:
    """GET an http(s) URL: at most max_bytes, all within fetch_timeout_s, redirects
    followed (http(s) only, to allowed hosts only, at most MAX_REDIRECTS). Blocking: run it
    on a thread pool.

    NOTE: http.client rather than urllib, for the socket: its timeout is re-armed with
    what is left of the deadline before every read, so a server that trickles bytes
    cannot stretch the fetch. The cost: no proxy from the environment.
    """
    deadline = time.monotonic() + policy.fetch_timeout_s
    for _ in range(MAX_REDIRECTS + 1):
        try:
            connection, target = _connection(url, deadline, policy)
            try:
                response, sock = _get(connection, target, deadline)
                with response:
                    location = response.getheader("Location")
                    if response.status in _REDIRECT_STATUSES and location:
                        url = urljoin(url, location)
                        continue
                    if response.status != 200:
                        raise ImageInputError(
                            f"fetching {_shown(url)} failed: HTTP {response.status} "
                            f"{response.reason}"
                        )
                    return _read_body(response, sock, deadline, url, policy)
            finally:
                connection.close()
        except ImageInputError:
            raise
        except TimeoutError:
            raise ImageInputError(
                f"fetching {_shown(url)} took longer than {policy.fetch_timeout_s} s"
            ) from None
        except (OSError, ValueError, http.client.HTTPException) as exc:
            # ValueError: a bad port, a path http.client will not send (not ASCII).
            raise ImageInputError(f"fetching {_shown(url)} failed: {exc}") from None
    raise ImageInputError(f"fetching {_shown(url)}: more than {MAX_REDIRECTS} redirects")


def _connection(
    url: str, deadline: float, policy: MediaPolicy
) -> tuple[http.client.HTTPConnection, str]:
    """An unopened connection to the URL's host (an allowed one), and the request target."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ImageInputError(f"cannot fetch {_shown(url)}: not an http(s) URL with a host")
    if not policy.allows_host(parts.hostname):
        raise ImageInputError(
            f"host {parts.hostname!r} is not one this server fetches images from "
            f"({MEDIA_DOMAINS_FLAG})"
        )
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname  # IPv6
    connection_type = (
        http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    )
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return connection_type(host, parts.port, timeout=_left_s(deadline)), target


def _get(
    connection: http.client.HTTPConnection, target: str, deadline: float
) -> tuple[http.client.HTTPResponse, socket.socket]:
    """Send the GET, read the status and headers: the response and its socket."""
    connection.connect()
    sock = connection.sock  # getresponse() drops it from the connection when will_close
    connection.request("GET", target, headers={"Accept": "image/*", "User-Agent": "ringllm"})
    sock.settimeout(_left_s(deadline))
    return connection.getresponse(), sock


def _read_body(
    response: http.client.HTTPResponse,
    sock: socket.socket,
    deadline: float,
    url: str,
    policy: MediaPolicy,
) -> bytes:
    declared = response.getheader("Content-Length")
    if declared is not None and declared.isdigit():
        _check_bytes(int(declared), policy, _shown(url))
    body = bytearray()
    while True:
        sock.settimeout(_left_s(deadline))
        chunk = response.read1(_READ_CHUNK_BYTES)
        if not chunk:
            return bytes(body)
        body += chunk
        _check_bytes(len(body), policy, _shown(url), exact=False)


def _left_s(deadline: float) -> float:
    left_s = deadline - time.monotonic()
    if left_s <= 0:
        raise TimeoutError
    return left_s


def decode_image(data: bytes, policy: MediaPolicy, load: bool = True) -> Image.Image:
    """Encoded bytes -> a loaded image (an animation's first frame), the size checked
    from the header before any pixel is decoded (`load` False: only that)."""
    with _pillow_bomb_warnings_raise():
        try:
            image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise ImageInputError(
                f"the image declares more than {Image.MAX_IMAGE_PIXELS} pixels, past the "
                f"limit of {policy.max_pixels} pixels"
            ) from None
        except UnidentifiedImageError:
            raise ImageInputError(
                f"not an image in a supported format ({', '.join(IMAGE_FORMATS)})"
            ) from None
        except Exception as exc:  # any failure to parse untrusted bytes
            raise ImageInputError(f"the image is truncated or corrupt ({exc})") from None
    check_pixels(image.size, policy)
    return load_pixels(image) if load else image


def check_pixels(size: tuple[int, int], policy: MediaPolicy) -> None:
    width, height = size
    if width * height > policy.max_pixels:
        raise ImageInputError(
            f"the image is {width}x{height} = {width * height} pixels, past the limit of "
            f"{policy.max_pixels} pixels"
        )


def load_pixels(image: Image.Image) -> Image.Image:
    """Run Pillow's decode (nothing for a loaded image); a truncated or corrupt image
    becomes an ImageInputError."""
    with _pillow_bomb_warnings_raise():
        try:
            image.load()
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise ImageInputError(f"a frame or tile declares too many pixels ({exc})") from None
        except Exception as exc:  # Pillow raises OSError, SyntaxError, EOFError, ...
            raise ImageInputError(f"the image is truncated or corrupt ({exc})") from None
    return image


@contextlib.contextmanager
def _pillow_bomb_warnings_raise() -> Iterator[None]:
    """Pillow's DecompressionBombWarning raised, so that it becomes our error, not a log line.

    NOTE: Pillow warns past its MAX_IMAGE_PIXELS inside Image.open, before we can look at
    the size. catch_warnings swaps the process-wide filters (before Python 3.14), so
    threads racing through it can leave this filter installed or, racing another user of
    catch_warnings, drop it for a moment. Neither is unsafe: a warning that is only
    printed still leaves an image past max_pixels (which is at most Pillow's limit), and
    check_pixels refuses it.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        yield


def _check_bytes(num_bytes: int, policy: MediaPolicy, what: str, exact: bool = True) -> None:
    """`exact`: num_bytes is the whole size, not just what was read so far."""
    if num_bytes > policy.max_bytes:
        size = f"{num_bytes} bytes" if exact else f"more than {policy.max_bytes} bytes"
        raise ImageInputError(f"{what} is {size}, past the limit of {policy.max_bytes} bytes")


def _shown(url: str) -> str:
    """A URL as an error message may quote it: never a data URL's payload, never long."""
    if url[:5].lower() == "data:":
        return "the data URL"
    return repr(url if len(url) <= 200 else url[:200] + "...")
