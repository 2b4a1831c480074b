"""Image inputs: data, file and http(s) URLs, content parts and decoding, within a MediaPolicy.

Real files in tmp folders, a real HTTP server on 127.0.0.1, real (and crafted) images.
"""

from __future__ import annotations

import base64
import io
import os
import struct
import threading
import time
import warnings
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ringllm.pipeline.frontend.image_inputs import (
    ImageInputError,
    MediaPolicy,
    decode_image,
    image_from_content_part,
    load_image,
)

POLICY = MediaPolicy()


def encoded(image: Image.Image, fmt: str = "PNG", **save_args) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **save_args)
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}


RED = Image.new("RGB", (7, 5), (255, 0, 0))
RED_PNG = encoded(RED)


def assert_red(image: Image.Image) -> None:
    assert image.size == (7, 5) and image.convert("RGB").getpixel((3, 2)) == (255, 0, 0)


def refused(match: str):
    """ValueError, ours, with a message fit for a 400."""
    return pytest.raises(ImageInputError, match=f"^image_url: .*{match}")


# -- data URLs --------------------------------------------------------------------------


def test_data_url():
    assert_red(image_from_content_part(part(data_url(RED_PNG)), POLICY))
    assert_red(image_from_content_part(part(data_url(RED_PNG, "image/jpeg")), POLICY))


@pytest.mark.parametrize(
    "url,match",
    [
        ("data:image/png;base64" + base64.b64encode(RED_PNG).decode(), "needs a ','"),
        ("data:image/png," + base64.b64encode(RED_PNG).decode(), "only base64 data URLs"),
        ("data:;base64,AAAA", "'' is not an image type"),
        ("data:text/plain;base64,aGVsbG8=", "'text/plain' is not an image type"),
        ("data:image/png;base64,iVBOR*w0KGgo=", "base64 is not valid"),
        ("data:image/png;base64,iVBORw0KGgo", "base64 is not valid"),  # bad padding
        ("data:image/png;base64,iVBO\nRw0KGgo=", "base64 is not valid"),  # whitespace
        ("data:image/png;base64,aGVsbG8gd29ybGQ=", "not an image in a supported format"),
        ("data:image/png;base64,", "not an image"),
    ],
)
def test_bad_data_urls(url, match):
    with refused(match):
        image_from_content_part(part(url), POLICY)


def test_data_url_past_max_bytes():
    with refused(f"past the limit of {len(RED_PNG) - 1} bytes"):
        load_image(data_url(RED_PNG), MediaPolicy(max_bytes=len(RED_PNG) - 1))
    with refused("past the limit of 100 bytes"):  # refused before decoding the base64
        load_image(data_url(b"\0" * 1000), MediaPolicy(max_bytes=100))
    assert_red(load_image(data_url(RED_PNG), MediaPolicy(max_bytes=len(RED_PNG))))


# -- content parts ----------------------------------------------------------------------


def test_content_part_forms():
    url = data_url(RED_PNG)
    assert_red(image_from_content_part({"image_url": url}, POLICY))  # vLLM's short form
    assert_red(image_from_content_part({"type": "image_url", "image_url": url}, POLICY))
    assert_red(image_from_content_part(RED.copy(), POLICY))  # the offline API
    with refused("type 'input_audio' is not an image_url part"):
        image_from_content_part({"type": "input_audio", "input_audio": {}}, POLICY)
    with refused("non-empty URL"):
        image_from_content_part({"type": "image_url", "image_url": {"detail": "low"}}, POLICY)
    with refused("must be an object"):
        image_from_content_part(["image_url"], POLICY)  # type: ignore[arg-type]


def test_a_pil_image_is_checked_and_loaded():
    lazy = Image.open(io.BytesIO(RED_PNG))
    assert_red(load_image(lazy, POLICY))
    with refused("7x5 = 35 pixels, past the limit of 34 pixels"):
        load_image(Image.open(io.BytesIO(RED_PNG)), MediaPolicy(max_pixels=34))


@pytest.mark.parametrize(
    "url,match",
    [
        ("ftp://example.com/a.png", "scheme 'ftp' is not supported"),
        ("javascript:alert(1)", "scheme 'javascript' is not supported"),
        ("s3://bucket/a.png", "scheme 's3' is not supported"),
        ("/etc/passwd", "is not a URL"),
        ("a.png", "is not a URL"),
        ("http://127.0.0.1/a.png", "http URLs are not allowed"),
        ("HTTPS://127.0.0.1/a.png", "https URLs are not allowed"),
    ],
)
def test_other_schemes_are_refused_by_name(url, match):
    with refused(match):
        load_image(url, POLICY)


# -- local files ------------------------------------------------------------------------


@pytest.fixture
def media(tmp_path) -> tuple[Path, MediaPolicy]:
    allowed = tmp_path / "media"
    (allowed / "sub").mkdir(parents=True)
    (allowed / "sub" / "red image.png").write_bytes(RED_PNG)
    (tmp_path / "secret.png").write_bytes(RED_PNG)
    return allowed, MediaPolicy(allowed_local_media_path=str(allowed))


def test_local_files_under_the_allowed_folder(media):
    allowed, policy = media
    path = allowed / "sub" / "red image.png"
    assert_red(load_image(path.as_uri(), policy))  # percent-encoded space
    assert_red(load_image(f"file://localhost{path}", policy))
    assert_red(load_image(path, policy))  # a Path: the offline API
    (allowed / "link.png").symlink_to(path)  # a link inside, to inside
    assert_red(load_image((allowed / "link.png").as_uri(), policy))


def test_local_files_off_by_default(media):
    allowed, _ = media
    with refused("start it with --allowed-local-media-path"):
        load_image((allowed / "sub" / "red image.png").as_uri(), POLICY)


def test_local_files_outside_the_allowed_folder(media):
    allowed, policy = media
    (allowed / "escape.png").symlink_to(allowed.parent / "secret.png")
    for url in (
        f"file://{allowed}/sub/../../secret.png",
        f"file://{allowed}/sub/%2e%2e/%2e%2e/secret.png",
        (allowed / "escape.png").as_uri(),
        "file:///etc/passwd",
        f"file://{allowed}_sibling/a.png",  # a prefix of the path is not a parent
    ):
        with refused("outside the folder --allowed-local-media-path allows"):
            load_image(url, policy)
    with refused("outside the folder"):
        load_image(allowed / ".." / "secret.png", policy)


def test_local_files_that_are_not_images(media):
    allowed, policy = media
    (allowed / "big.png").write_bytes(RED_PNG + b"\0" * 100)
    os.mkfifo(allowed / "fifo")
    (allowed / "notes.txt").write_text("hello")
    with refused("No such file"):
        load_image((allowed / "nothing.png").as_uri(), policy)
    with refused("is not a regular file"):
        load_image(allowed.as_uri(), policy)
    with refused("is not a regular file"):  # and does not hang waiting for a writer
        load_image((allowed / "fifo").as_uri(), policy)
    with refused("not an image"):
        load_image((allowed / "notes.txt").as_uri(), policy)
    small = MediaPolicy(allowed_local_media_path=str(allowed), max_bytes=len(RED_PNG) + 99)
    with refused(f"is {len(RED_PNG) + 100} bytes, past the limit"):
        load_image((allowed / "big.png").as_uri(), small)
    (allowed / "loop").symlink_to(allowed / "loop")
    with refused("cannot resolve"):
        load_image((allowed / "loop").as_uri(), policy)
    with refused("cannot resolve"):
        load_image(f"file://{allowed}/a%00b.png", policy)
    with refused("host 'example.com' is not this machine"):
        load_image(f"file://example.com{allowed}/sub/red%20image.png", policy)


def test_policy_checks_its_fields(tmp_path):
    with pytest.raises(ValueError, match="--allowed-local-media-path: .* is not a folder"):
        MediaPolicy(allowed_local_media_path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="max_bytes must be at least 1 byte"):
        MediaPolicy(max_bytes=0)
    with pytest.raises(ValueError, match="max_pixels must be at least 1 pixel"):
        MediaPolicy(max_pixels=0)
    with pytest.raises(ValueError, match="max_pixels must be at most Pillow's limit"):
        MediaPolicy(max_pixels=Image.MAX_IMAGE_PIXELS + 1)
    with pytest.raises(ValueError, match="fetch_timeout_s must be above 0 s"):
        MediaPolicy(fetch_timeout_s=0)


# -- decoding ---------------------------------------------------------------------------


def png_declaring(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height and whose data is a few bytes."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body)
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize(
    "width,height", [(3000, 3000), (10000, 10000), (20000, 20000), (1, 2**31 - 1)]
)
def test_decompression_bombs_are_refused_from_the_header(width, height):
    # 9M pixels: past ours only; 100M: past Pillow's warning; 400M+: past Pillow's error.
    policy = MediaPolicy(max_pixels=1 << 20)
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with refused("past the limit of 1048576 pixels"):
            decode_image(png_declaring(width, height), policy)
    assert caught == []  # not even Pillow's DecompressionBombWarning gets out
    assert time.monotonic() - start < 1.0  # nothing was decoded


def test_truncated_and_corrupt_images():
    photo = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), np.uint8))
    for data in (
        encoded(photo)[:-200],
        encoded(photo, "JPEG")[:-300],
        encoded(photo, "GIF")[:-100],
        encoded(photo, "WEBP")[:-100],
    ):
        with refused("truncated or corrupt"):
            decode_image(data, POLICY)
    png = bytearray(encoded(photo))
    png[100:140] = b"\xff" * 40  # inside the image data: a bad CRC / stream
    with refused("truncated or corrupt"):
        decode_image(bytes(png), POLICY)
    with refused("not an image"):  # a signature, then no header
        decode_image(b"\x89PNG\r\n\x1a\n" + b"\0" * 30, POLICY)


def test_formats_outside_the_list_are_refused():
    for fmt in ("ICO", "TGA", "PPM"):
        with refused("not an image in a supported format"):
            decode_image(encoded(RED, fmt), POLICY)
    for fmt in ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"):
        assert decode_image(encoded(RED, fmt), POLICY).size == (7, 5)


def test_an_animated_gif_gives_its_first_frame():
    frames = [Image.new("RGB", (7, 5), color) for color in ("red", "blue", "green")]
    gif = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50)
    assert Image.open(io.BytesIO(gif)).n_frames == 3
    assert_red(decode_image(gif, POLICY))


# -- http(s) ----------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive where a length is sent
    stop = threading.Event()

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        route = getattr(self, "route_" + self.path.strip("/").split("?")[0].replace("-", "_"))
        route()

    def _send(self, status: int, headers: dict, body: bytes = b"") -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def route_red(self) -> None:
        self._send(200, {"Content-Type": "image/png", "Content-Length": len(RED_PNG)}, RED_PNG)

    def route_missing(self) -> None:
        self._send(404, {"Content-Length": 0})

    def route_declared_big(self) -> None:
        self._send(200, {"Content-Length": 10**9, "Connection": "close"})
        self.close_connection = True

    def route_streamed_big(self) -> None:  # no length: the body ends at close
        self._send(200, {"Connection": "close"})
        self.close_connection = True
        try:
            for _ in range(1000):
                self.wfile.write(b"\0" * 65536)
        except OSError:
            pass  # the client stopped reading, as it should

    def route_chunked_red(self) -> None:
        self._send(200, {"Transfer-Encoding": "chunked"})
        for i in range(0, len(RED_PNG), 10):
            piece = RED_PNG[i : i + 10]
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        self.wfile.write(b"0\r\n\r\n")

    def route_slow_headers(self) -> None:
        self.stop.wait(5)
        self.close_connection = True

    def route_trickle(self) -> None:  # a byte every 50 ms: each read is quick, the whole is not
        self._send(200, {"Content-Length": 1000, "Connection": "close"})
        self.close_connection = True
        try:
            while not self.stop.wait(0.05):
                self.wfile.write(b"\0")
                self.wfile.flush()
        except OSError:
            pass

    def route_redirect(self) -> None:
        self._send(302, {"Location": "/red?from=redirect", "Content-Length": 0})

    def route_redirect_file(self) -> None:
        self._send(302, {"Location": "file:///etc/passwd", "Content-Length": 0})

    def route_loop(self) -> None:
        self._send(307, {"Location": "/loop", "Content-Length": 0})

    def route_redirect_localhost(self) -> None:  # the same server under another host name
        location = f"http://localhost:{self.server.server_address[1]}/red"
        self._send(302, {"Location": location, "Content-Length": 0})


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    _Handler.stop.clear()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    _Handler.stop.set()
    httpd.shutdown()
    httpd.server_close()


HTTP = MediaPolicy(allow_http=True, max_bytes=1 << 20, fetch_timeout_s=0.5)


def test_http_fetch(server):
    assert_red(image_from_content_part(part(f"{server}/red"), HTTP))
    assert_red(load_image(f"{server}/chunked-red", HTTP))
    assert_red(load_image(f"{server}/redirect", HTTP))


def test_http_errors(server):
    with refused("/missing' failed: HTTP 404"):
        load_image(f"{server}/missing", HTTP)
    with refused("is 1000000000 bytes, past the limit of 1048576 bytes"):
        load_image(f"{server}/declared-big", HTTP)
    with refused("is more than 1048576 bytes, past the limit"):
        load_image(f"{server}/streamed-big", HTTP)
    with refused("cannot fetch 'file:///etc/passwd': not an http"):
        load_image(f"{server}/redirect-file", HTTP)
    with refused("more than 5 redirects"):
        load_image(f"{server}/loop", HTTP)
    with refused("failed: .*refused"):
        load_image("http://127.0.0.1:1/red", HTTP)  # nothing listens on port 1


@pytest.mark.parametrize("route", ["slow-headers", "trickle"])
def test_http_timeout_bounds_the_whole_fetch(server, route):
    start = time.monotonic()
    with refused("took longer than 0.5 s"):
        load_image(f"{server}/{route}", HTTP)
    assert time.monotonic() - start < 1.5


def test_http_only_to_allowed_domains(server):
    only_this = MediaPolicy(allow_http=True, allowed_domains=("127.0.0.1",), fetch_timeout_s=0.5)
    assert_red(load_image(f"{server}/red", only_this))
    assert_red(load_image(f"{server}/redirect", only_this))  # same host
    elsewhere = MediaPolicy(allow_http=True, allowed_domains=("images.example.com",))
    with refused("host '127.0.0.1' is not one this server fetches images from"):
        load_image(f"{server}/red", elsewhere)
    with refused("host 'localhost' is not one this server fetches images from"):
        load_image(f"{server}/redirect-localhost", only_this)  # each hop is checked


def test_allowed_domains_are_exact_host_names():
    policy = MediaPolicy(allow_http=True, allowed_domains=(" Images.Example.COM ",))
    assert policy.allowed_domains == ("images.example.com",)
    assert policy.allows_host("IMAGES.example.com")
    assert not policy.allows_host("evil.images.example.com")
    assert not policy.allows_host("images.example.com.evil")
    assert MediaPolicy(allow_http=True).allows_host("any.host")  # the default: "*"
    assert not MediaPolicy(allowed_domains=("*",)).allows_host("any.host")  # http off
    with pytest.raises(ValueError, match="empty host name"):
        MediaPolicy(allow_http=True, allowed_domains=("a.com", " "))
