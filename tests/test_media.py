"""shoal.server.media: image input from data: URIs, http(s) URLs and file:// URLs.

Images are made in memory with Pillow; the only network is an http.server thread on
127.0.0.1 (module-scoped), which records every request so a test can assert that a
refused URL was never connected to. Names other than localhost resolve through a fake
resolver (`network`), which also records every address dialed.
"""

from __future__ import annotations

import base64
import hashlib
import io
import socket
import ssl
import struct
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from PIL import Image

from shoal.server import media
from shoal.server.media import (
    LoadedImage,
    MediaError,
    MediaPolicy,
    check_count,
    decode_image,
    load_base64_image,
    load_image,
)
from shoal.multimodal import pixel_digest

WHERE = "messages[0].content[1].image_url"
DEFAULT = MediaPolicy()


def gradient(size: tuple[int, int] = (32, 24)) -> Image.Image:
    """Every pixel different, so a lossless round trip that moved or changed one shows."""
    width, height = size
    image = Image.new("RGB", size)
    image.putdata([(x * 7 % 256, y * 11 % 256, (x * y) % 256) for y in range(height) for x in range(width)])
    return image


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def data_uri(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims width x height (1-bit grey) but whose pixel data is 64 bytes:
    decoding it would fail as truncated, so a "too large" answer proves the header check ran first."""

    def chunk(tag: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


def refusal(call, *args) -> str:
    with pytest.raises(MediaError) as caught:
        call(*args)
    error = caught.value
    assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)  # no chained traceback
    return str(caught.value)


# ---- data: URIs and decoding ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "media_type", "options"),
    [
        ("PNG", "image/png", {}),
        ("WEBP", "image/webp", {"lossless": True}),
        ("GIF", "image/gif", {}),
        ("JPEG", "image/jpeg", {"quality": 95}),
    ],
)
def test_data_uri_formats(fmt, media_type, options):
    picture = gradient()
    loaded = load_image(data_uri(encode(picture, fmt, **options), media_type), DEFAULT, WHERE)
    assert isinstance(loaded, LoadedImage)
    assert (loaded.format, loaded.source, loaded.image.mode, loaded.image.size) == (fmt, "base64", "RGB", (32, 24))
    if fmt in ("PNG", "WEBP"):  # lossless: every pixel back
        assert loaded.image.tobytes() == picture.tobytes()


def test_image_jpg_alias_and_untyped_data_uri():
    jpeg = encode(gradient(), "JPEG")
    assert load_image(data_uri(jpeg, "image/jpg"), DEFAULT, WHERE).format == "JPEG"
    assert load_image(data_uri(jpeg, "application/octet-stream"), DEFAULT, WHERE).format == "JPEG"
    assert load_image("data:;base64," + base64.b64encode(jpeg).decode(), DEFAULT, WHERE).format == "JPEG"


@pytest.mark.parametrize("fmt", ["GIF", "WEBP", "PNG"])
def test_animated_image_gives_first_frame(fmt):
    red, blue = Image.new("RGB", (8, 8), (255, 0, 0)), Image.new("RGB", (8, 8), (0, 0, 255))
    options = {"lossless": True} if fmt == "WEBP" else {}
    data = encode(red, fmt, save_all=True, append_images=[blue], duration=100, loop=0, **options)
    assert Image.open(io.BytesIO(data)).n_frames == 2  # really animated
    loaded = decode_image(data, DEFAULT, WHERE, "base64")
    assert loaded.image.getpixel((4, 4)) == (255, 0, 0)


def test_modes_converted_to_rgb():
    rgba = Image.new("RGBA", (4, 4), (10, 20, 30, 0))  # alpha dropped, not composited on white
    assert decode_image(encode(rgba, "PNG"), DEFAULT, WHERE, "base64").image.getpixel((0, 0)) == (10, 20, 30)

    palette = Image.new("P", (4, 4), 1)
    palette.putpalette([0, 0, 0, 200, 100, 50] + [0] * 762)
    assert decode_image(encode(palette, "PNG"), DEFAULT, WHERE, "base64").image.getpixel((0, 0)) == (200, 100, 50)

    grey = Image.new("L", (4, 4), 77)
    assert decode_image(encode(grey, "PNG"), DEFAULT, WHERE, "base64").image.getpixel((0, 0)) == (77, 77, 77)

    grey_alpha = Image.new("LA", (4, 4), (90, 0))
    assert decode_image(encode(grey_alpha, "PNG"), DEFAULT, WHERE, "base64").image.getpixel((0, 0)) == (90, 90, 90)

    cmyk = Image.new("CMYK", (8, 8), (0, 0, 0, 0))  # no ink: white
    loaded = decode_image(encode(cmyk, "JPEG", quality=100), DEFAULT, WHERE, "base64")
    assert loaded.image.mode == "RGB" and all(c >= 250 for c in loaded.image.getpixel((4, 4)))

    deep = Image.new("I;16", (2, 1))  # 16-bit grey: scaled to 8 bits, not clipped to white
    deep.putpixel((0, 0), 30000)
    deep.putpixel((1, 0), 65535)
    loaded = decode_image(encode(deep, "PNG"), DEFAULT, WHERE, "base64")
    assert [loaded.image.getpixel((x, 0)) for x in range(2)] == [(117, 117, 117), (255, 255, 255)]


def test_declared_type_must_match_content():
    png = encode(gradient(), "PNG")
    message = refusal(load_image, data_uri(png, "image/jpeg"), DEFAULT, WHERE)
    assert message == f"the image at {WHERE} is declared as image/jpeg but is a PNG image (image/png)"


def test_unsupported_declared_types_refused():
    svg = b'<svg xmlns="http://www.w3.org/2000/svg" width="4" height="4"/>'
    message = refusal(load_image, data_uri(svg, "image/svg+xml"), DEFAULT, WHERE)
    assert "image/svg+xml, which is not supported" in message
    bmp = encode(gradient(), "BMP")
    assert "image/bmp, which is not supported" in refusal(load_image, data_uri(bmp, "image/bmp"), DEFAULT, WHERE)


@pytest.mark.parametrize(
    "data",
    [
        encode(gradient(), "BMP"),  # Pillow reads BMP; the formats= list keeps it off
        encode(gradient(), "TIFF"),
        b'<svg xmlns="http://www.w3.org/2000/svg" width="4" height="4"/>',
        b"hello, this is text and not an image",
        b"",
    ],
    ids=["bmp", "tiff", "svg", "text", "empty"],
)
def test_non_images_refused(data):
    message = refusal(decode_image, data, DEFAULT, WHERE, "base64")
    assert message == f"the image at {WHERE} is not a PNG, JPEG, WebP or GIF image"


def test_base64_validated_strictly():
    assert "is not valid base64" in refusal(load_image, "data:image/png;base64,iVBO@@@@", DEFAULT, WHERE)
    assert "is not valid base64" in refusal(load_image, "data:image/png;base64,iVBOR", DEFAULT, WHERE)  # bad length
    assert "is not valid base64" in refusal(load_image, "data:image/png;base64,ïVBO", DEFAULT, WHERE)
    assert "is not base64" in refusal(load_image, "data:image/png,rawbytes", DEFAULT, WHERE)
    assert "without a ','" in refusal(load_image, "data:image/png;base64", DEFAULT, WHERE)
    assert "is empty" in refusal(load_image, "data:image/png;base64,", DEFAULT, WHERE)


def test_base64_whitespace_allowed():
    encoded = base64.encodebytes(encode(gradient(), "PNG")).decode()  # MIME style: a newline every 76 chars
    assert "\n" in encoded
    assert load_image(f"data:image/png;base64,{encoded}", DEFAULT, WHERE).image.size == (32, 24)


def test_truncated_images_refused():
    png = encode(gradient((64, 64)), "PNG")
    message = refusal(decode_image, png[: len(png) * 2 // 3], DEFAULT, WHERE, "base64")
    assert message == f"the image at {WHERE} is truncated or damaged: it could not be decoded"
    jpeg = encode(gradient((64, 64)), "JPEG")
    assert "is truncated" in refusal(decode_image, jpeg[: len(jpeg) // 2], DEFAULT, WHERE, "base64")


def test_decompression_bomb_refused_from_header():
    # Past Pillow's own limit (2 x Image.MAX_IMAGE_PIXELS): refused inside Image.open.
    message = refusal(decode_image, png_header_only(20000, 20000), DEFAULT, WHERE, "base64")
    assert message == f"the image at {WHERE} is larger than 8192x8192 pixels"
    # Under Pillow's limit, over ours: our header check (decoding would say "truncated").
    message = refusal(decode_image, png_header_only(9000, 9000), DEFAULT, WHERE, "base64")
    assert message == f"the image at {WHERE} is 9000x9000 pixels, larger than 8192x8192 pixels"


def test_pixel_cap_from_policy():
    small = MediaPolicy(max_image_pixels=32 * 23)
    assert "is 32x24 pixels, larger than 736 pixels" in refusal(
        decode_image, encode(gradient(), "PNG"), small, WHERE, "base64"
    )
    assert decode_image(encode(gradient(), "PNG"), MediaPolicy(max_image_pixels=32 * 24), WHERE, "base64")


def test_byte_cap_refused_before_base64_decoding(monkeypatch):
    def must_not_decode(*args, **kwargs):
        raise AssertionError("b64decode called for an over-size image")

    monkeypatch.setattr(media.base64, "b64decode", must_not_decode)
    policy = MediaPolicy(max_image_bytes=1000)
    huge = "data:image/png;base64," + "A" * 4_000_000  # 3 MB once decoded
    message = refusal(load_image, huge, policy, WHERE)
    assert message == f"the image at {WHERE} is larger than the 1000 byte limit"
    assert "is larger than" in refusal(load_base64_image, "A" * 1336, None, policy, WHERE)  # 1002 bytes


def test_byte_cap_at_decode():
    png = encode(gradient(), "PNG")
    exact = MediaPolicy(max_image_bytes=len(png))
    assert decode_image(png, exact, WHERE, "base64").format == "PNG"
    assert load_image(data_uri(png), exact, WHERE).format == "PNG"  # the length estimate is exact
    smaller = MediaPolicy(max_image_bytes=len(png) - 1)
    assert "is larger than" in refusal(decode_image, png, smaller, WHERE, "base64")
    assert "is larger than" in refusal(load_image, data_uri(png), smaller, WHERE)


def test_anthropic_base64():
    png = encode(gradient(), "PNG")
    text = base64.b64encode(png).decode()
    assert load_base64_image(text, "image/png", DEFAULT, WHERE).format == "PNG"
    assert load_base64_image(text, None, DEFAULT, WHERE).source == "base64"
    assert refusal(load_base64_image, text, "image/webp", DEFAULT, WHERE) == (
        f"the image at {WHERE} is declared as image/webp but is a PNG image (image/png)"
    )
    assert "media_type 'image/bmp', which is not supported" in refusal(
        load_base64_image, text, "image/bmp", DEFAULT, WHERE
    )
    assert "is not valid base64" in refusal(load_base64_image, "not base64!", "image/png", DEFAULT, WHERE)


def test_other_schemes_refused():
    assert "has the scheme 'ftp:'" in refusal(load_image, "ftp://127.0.0.1/x.png", DEFAULT, WHERE)
    assert "has no scheme" in refusal(load_image, "/etc/passwd", DEFAULT, WHERE)
    assert "empty URL" in refusal(load_image, "", DEFAULT, WHERE)


# ---- pixel_digest --------------------------------------------------------------------------


def test_pixel_digest_same_pixels_same_digest(tmp_path):
    picture = gradient()
    png, webp = encode(picture, "PNG"), encode(picture, "WEBP", lossless=True)
    (tmp_path / "a.png").write_bytes(png)
    policy = MediaPolicy(local_root=tmp_path)
    digests = {
        pixel_digest(load_image(data_uri(png), policy, WHERE).image),
        pixel_digest(load_image(data_uri(webp, "image/webp"), policy, WHERE).image),
        pixel_digest(load_base64_image(base64.b64encode(png).decode(), "image/png", policy, WHERE).image),
        pixel_digest(load_image((tmp_path / "a.png").as_uri(), policy, WHERE).image),
        pixel_digest(picture),
    }
    assert len(digests) == 1 and len(digests.pop()) == 32


def test_pixel_digest_changes_with_pixels_and_size():
    picture = gradient()
    changed = picture.copy()
    changed.putpixel((31, 23), (0, 0, 0) if picture.getpixel((31, 23)) != (0, 0, 0) else (1, 1, 1))
    assert pixel_digest(changed) != pixel_digest(picture)
    # Same bytes, other shape: 32x24 and 24x32 hold the same number of pixels.
    reshaped = Image.frombytes("RGB", (24, 32), picture.tobytes())
    assert pixel_digest(reshaped) != pixel_digest(picture)


def test_pixel_digest_strips_hash_like_one_buffer():
    tall = gradient((3, 700))  # more rows than one strip
    assert pixel_digest(tall) == hashlib.sha256(b"RGB:3x700:" + tall.tobytes()).digest()


# ---- http(s) -------------------------------------------------------------------------------

IMAGE_PNG = encode(gradient(), "PNG")


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        server = self.server
        server.seen.append((self.path, dict(self.headers)))
        path = self.path
        try:
            if path == "/img.png":
                self._send(200, IMAGE_PNG, {"Content-Type": "image/png"})
            elif path == "/redirect":
                self._send(302, b"", {"Location": "/img.png", "Set-Cookie": "session=secret; Path=/"})
            elif path.startswith("/chain/"):
                left = int(path.rsplit("/", 1)[1])
                if left == 0:
                    self._send(200, IMAGE_PNG, {})
                else:
                    self._send(302, b"", {"Location": f"/chain/{left - 1}"})
            elif path == "/loop":
                self._send(302, b"", {"Location": "/loop"})
            elif path == "/to-localhost":
                self._send(302, b"", {"Location": f"http://localhost:{server.server_port}/img.png"})
            elif path.startswith("/to/"):  # /to/<host>: a redirect to that host name, same port
                host = path[len("/to/") :]
                self._send(302, b"", {"Location": f"http://{host}:{server.server_port}/img.png"})
            elif path == "/to-ftp":
                self._send(302, b"", {"Location": "ftp://127.0.0.1/img.png"})
            elif path == "/big":
                self._send(200, b"\0" * 5000, {})
            elif path == "/big-unsized":  # HTTP/1.0, no Content-Length: the body ends at close
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"\0" * 5000)
            elif path == "/gzip":
                self._send(200, zlib.compress(IMAGE_PNG), {"Content-Encoding": "gzip"})
            elif path == "/slow":  # no answer at all until well after the client gave up
                server.stopping.wait(3)
                self._send(200, IMAGE_PNG, {})
            elif path == "/trickle":  # one byte every 0.1 s: no single read times out
                self.send_response(200)
                self.send_header("Content-Length", str(len(IMAGE_PNG)))
                self.end_headers()
                for byte in IMAGE_PNG:
                    if server.stopping.wait(0.1):
                        return
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
            else:
                self._send(404, b"not found", {})
        except OSError:  # the client hung up (timeouts, caps): expected here
            pass

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # a /slow handler must not hold up the fixture's teardown

    def handle_error(self, request, client_address) -> None:
        pass


@pytest.fixture(scope="module")
def server():
    httpd = _Server(("127.0.0.1", 0), _Handler)
    httpd.seen = []
    httpd.stopping = threading.Event()
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield httpd
    httpd.stopping.set()
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=5)


def url(server, path: str) -> str:
    return f"http://127.0.0.1:{server.server_port}{path}"


LOOPBACK = MediaPolicy(allowed_domains=("127.0.0.1",), allow_private_addresses=True)


def test_fetching_off_by_default(server):
    before = len(server.seen)
    message = refusal(load_image, url(server, "/img.png"), DEFAULT, WHERE)
    assert message == (
        f"the image at {WHERE} is a URL, but URL fetching is off: "
        "start the server with --allowed-media-domains to allow it"
    )
    assert len(server.seen) == before


def test_fetch_image(server):
    loaded = load_image(url(server, "/img.png"), LOOPBACK, WHERE)
    assert (loaded.format, loaded.source) == ("PNG", "url")
    assert loaded.image.tobytes() == gradient().tobytes()
    path, headers = server.seen[-1]
    assert path == "/img.png" and headers["User-Agent"] == "shoal"
    assert "Authorization" not in headers and "Cookie" not in headers


def test_loopback_refused_unless_private_addresses_allowed(server):
    before = len(server.seen)
    for allowed, target in [
        (("127.0.0.1",), url(server, "/img.png")),
        (("localhost",), f"http://localhost:{server.server_port}/img.png"),
        (("::1",), f"http://[::1]:{server.server_port}/img.png"),
    ]:
        message = refusal(load_image, target, MediaPolicy(allowed_domains=allowed), WHERE)
        assert message.startswith(f"the image URL at {WHERE} is not allowed: the host '")
        assert message.endswith("resolves to a private or loopback address")
    assert len(server.seen) == before  # refused before connecting


def test_domain_not_in_list_refused(server):
    policy = MediaPolicy(allowed_domains=("*.example.com",), allow_private_addresses=True)
    before = len(server.seen)
    assert refusal(load_image, url(server, "/img.png"), policy, WHERE) == (
        f"the image URL at {WHERE} is not allowed: the domain '127.0.0.1' is not in --allowed-media-domains"
    )
    for host in ("evil-example.com", "example.com", "example.com.evil.net"):
        assert f"the domain '{host}' is not in" in refusal(load_image, f"http://{host}/x.png", policy, WHERE)
    assert len(server.seen) == before


def test_domain_matching():
    allowed = MediaPolicy(allowed_domains=("Images.Example.COM.", "*.cdn.example.net", "[::1]")).allowed_domains
    assert allowed == ("images.example.com", "*.cdn.example.net", "::1")
    assert media._host_allowed("images.example.com", allowed)
    assert media._host_allowed("a.cdn.example.net", allowed) and media._host_allowed("a.b.cdn.example.net", allowed)
    assert not media._host_allowed("cdn.example.net", allowed)
    assert not media._host_allowed("xcdn.example.net", allowed)
    assert not media._host_allowed("example.com", allowed)
    assert media._host_allowed("::1", allowed)


@pytest.mark.parametrize(
    ("address", "public"),
    [
        ("8.8.8.8", True),
        ("2606:4700:4700::1111", True),
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("192.168.0.1", False),
        ("169.254.169.254", False),  # cloud metadata
        ("100.64.0.1", False),  # shared address space
        ("0.0.0.0", False),
        ("224.0.0.1", False),
        ("240.0.0.1", False),
        ("::1", False),
        ("::", False),
        ("fe80::1%eth0", False),
        ("fc00::1", False),
        ("::ffff:127.0.0.1", False),
        ("2002:7f00:1::", False),  # 6to4 around 127.0.0.1
    ],
)
def test_public_address(address, public):
    assert media._is_public_address(address) is public


def test_redirect_followed_without_cookies(server):
    loaded = load_image(url(server, "/redirect"), LOOPBACK, WHERE)
    assert loaded.image.size == (32, 24)
    assert [path for path, _ in server.seen[-2:]] == ["/redirect", "/img.png"]
    assert "Cookie" not in server.seen[-1][1]


def test_redirect_to_host_not_in_list_refused(server):
    before = len(server.seen)
    message = refusal(load_image, url(server, "/to-localhost"), LOOPBACK, WHERE)
    assert message == (
        f"the image URL at {WHERE} redirects to http://localhost:{server.server_port}/img.png, which is not allowed: "
        "the domain 'localhost' is not in --allowed-media-domains"
    )
    assert [path for path, _ in server.seen[before:]] == ["/to-localhost"]
    assert "which is not allowed: only http and https" in refusal(load_image, url(server, "/to-ftp"), LOOPBACK, WHERE)


def test_redirect_to_private_address_refused(server):
    # Allowed by name, but the second hop resolves to loopback: re-checked on every hop.
    policy = MediaPolicy(allowed_domains=("127.0.0.1", "localhost"))
    message = refusal(load_image, url(server, "/to-localhost"), policy, WHERE)
    assert "is not allowed: the host '127.0.0.1' resolves to a private or loopback address" in message


def test_redirect_limit(server):
    assert load_image(url(server, "/chain/3"), LOOPBACK, WHERE).format == "PNG"
    assert "redirects more than 3 times" in refusal(load_image, url(server, "/chain/4"), LOOPBACK, WHERE)
    assert "redirects more than 3 times" in refusal(load_image, url(server, "/loop"), LOOPBACK, WHERE)
    no_redirects = MediaPolicy(allowed_domains=("127.0.0.1",), allow_private_addresses=True, max_redirects=0)
    assert "redirects more than 0 times" in refusal(load_image, url(server, "/redirect"), no_redirects, WHERE)


def test_userinfo_refused(server):
    before = len(server.seen)
    target = f"http://user:hunter2@127.0.0.1:{server.server_port}/img.png"
    message = refusal(load_image, target, LOOPBACK, WHERE)
    assert message == f"the image URL at {WHERE} is not allowed: URLs with a user name or password are refused"
    assert len(server.seen) == before


def test_http_errors(server):
    assert refusal(load_image, url(server, "/missing"), LOOPBACK, WHERE) == (
        f"could not fetch the image at {WHERE} ({url(server, '/missing')}): the server answered HTTP 404 Not Found"
    )
    small = MediaPolicy(allowed_domains=("127.0.0.1",), allow_private_addresses=True, max_image_bytes=1000)
    for path in ("/big", "/big-unsized"):
        assert refusal(load_image, url(server, path), small, WHERE).endswith(
            ": the image is larger than the 1000 byte limit"
        )
    assert "compressed body (Content-Encoding: gzip)" in refusal(load_image, url(server, "/gzip"), LOOPBACK, WHERE)


def test_connection_refused():
    with socket.socket() as probe:  # a port nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    message = refusal(load_image, f"http://127.0.0.1:{port}/img.png", LOOPBACK, WHERE)
    assert message.endswith(": could not connect to the server")


@pytest.mark.parametrize("path", ["/slow", "/trickle"])
def test_fetch_timeout(server, path):
    """The deadline covers the whole fetch: /slow answers after 3 s and /trickle sends a byte every 0.1 s (no read
    waits long), so either would succeed, not time out, if the timeout were per read. No wall-time bound: a busy
    machine may take longer to notice."""
    policy = MediaPolicy(allowed_domains=("127.0.0.1",), allow_private_addresses=True, fetch_timeout_s=0.5)
    assert refusal(load_image, url(server, path), policy, WHERE).endswith(": timed out")


# ---- pinned connections: no second lookup (DNS rebinding) ----------------------------------

PUBLIC_A, PUBLIC_B = "8.8.8.8", "8.8.4.4"  # answers of the fake resolver; never really dialed
_REAL_GETADDRINFO, _REAL_CREATE_CONNECTION = socket.getaddrinfo, socket.create_connection


class _Network:
    """A fake resolver and dialer in place of socket.getaddrinfo and socket.create_connection.

    Only the names in `answers` are faked: each lookup takes the next answer (the last one
    repeats), so a name can resolve to a public address first and to loopback the second
    time, as a rebinding DNS server would. Every dial is recorded (a dial by name looks the
    name up again, as the real one does); a dial to anything but loopback is refused, except
    to a `stand_ins` address, which the loopback server answers for (same port), so a
    "public" host can serve the test. Nothing leaves the machine.
    """

    def __init__(self) -> None:
        self.answers: dict[str, list[tuple[str, ...]]] = {}
        self.asked: list[str] = []
        self.dialed: list[str] = []
        self.stand_ins: set[str] = set()
        self.slow: set[str] = set()  # names whose lookup waits for `release` (at most 20 s)
        self.release = threading.Event()
        self.answered: list[str] = []  # names whose lookup has returned

    def getaddrinfo(self, host, port, *args, **kwargs):
        if host not in self.answers:
            return _REAL_GETADDRINFO(host, port, *args, **kwargs)
        self.asked.append(host)
        if host in self.slow:
            self.release.wait(20)
        turns = self.answers[host]
        addresses = turns.pop(0) if len(turns) > 1 else turns[0]
        self.answered.append(host)
        return [
            (socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (a, port))
            for a in addresses
        ]

    def create_connection(self, address, *args, **kwargs):
        host, port = address[:2]
        self.dialed.append(host)
        if host in self.answers:  # a name: looked up, as the real create_connection would
            host = self.getaddrinfo(host, port)[0][4][0]
        if host in self.stand_ins:
            return _REAL_CREATE_CONNECTION(("127.0.0.1", port), *args, **kwargs)
        if host not in ("127.0.0.1", "::1"):
            raise ConnectionRefusedError(f"the test network refuses {host}")
        return _REAL_CREATE_CONNECTION(address, *args, **kwargs)


@pytest.fixture
def network(monkeypatch):
    fake = _Network()
    monkeypatch.setattr(socket, "getaddrinfo", fake.getaddrinfo)
    monkeypatch.setattr(socket, "create_connection", fake.create_connection)
    yield fake
    fake.release.set()  # a lookup the fetch gave up on ends now


def test_fetch_connects_to_the_checked_address_not_a_second_lookup(server, network):
    # The first answer is public and passes the check; a second lookup would get loopback.
    network.answers["rebind.test"] = [(PUBLIC_A,), ("127.0.0.1",)]
    policy = MediaPolicy(allowed_domains=("rebind.test",))
    target = f"http://rebind.test:{server.server_port}/img.png"
    before = len(server.seen)
    assert refusal(load_image, target, policy, WHERE) == (
        f"could not fetch the image at {WHERE} ({target}): could not connect to the server"
    )
    assert network.dialed == [PUBLIC_A]  # the vetted address, and nothing else
    assert network.asked == ["rebind.test"]  # resolved once
    assert len(server.seen) == before  # the loopback server was never reached

    # When the vetted address answers, the image comes from it, asked for by name.
    network.stand_ins.add(PUBLIC_A)
    network.answers["rebind.test"] = [(PUBLIC_A,), ("127.0.0.1",)]
    assert load_image(target, policy, WHERE).image.tobytes() == gradient().tobytes()
    assert network.dialed == [PUBLIC_A, PUBLIC_A]
    assert server.seen[-1][1]["Host"] == f"rebind.test:{server.server_port}"


def test_vetted_addresses_tried_in_order(server, network):
    network.answers["images.test"] = [(PUBLIC_A, PUBLIC_B)]
    network.stand_ins.add(PUBLIC_B)  # PUBLIC_A refuses the connection
    policy = MediaPolicy(allowed_domains=("images.test",))
    assert load_image(f"http://images.test:{server.server_port}/img.png", policy, WHERE).format == "PNG"
    assert network.dialed == [PUBLIC_A, PUBLIC_B]
    assert network.asked == ["images.test"]


def test_pinned_fetch_sends_the_name_as_host(server, network):
    network.answers["images.test"] = [("127.0.0.1",)]  # a name no real resolver knows
    policy = MediaPolicy(allowed_domains=("images.test",), allow_private_addresses=True)
    loaded = load_image(f"http://images.test:{server.server_port}/img.png", policy, WHERE)
    assert loaded.image.tobytes() == gradient().tobytes()
    path, headers = server.seen[-1]
    assert path == "/img.png" and headers["Host"] == f"images.test:{server.server_port}"
    assert network.dialed == ["127.0.0.1"] and network.asked == ["images.test"]


def test_pinned_tls_checks_the_name(network, monkeypatch):
    # The dial goes to the vetted address; SNI and the certificate check stay on the name.
    handshakes = []

    def wrap_socket(context, sock, *args, server_hostname=None, **kwargs):
        handshakes.append((server_hostname, context.check_hostname, context.verify_mode))
        raise ssl.SSLError("the test stops at the handshake")

    monkeypatch.setattr(ssl.SSLContext, "wrap_socket", wrap_socket)
    network.answers["images.test"] = [(PUBLIC_A,), ("127.0.0.1",)]
    network.stand_ins.add(PUBLIC_A)
    with socket.socket() as listener:  # what the stand-in reaches: it only has to accept the TCP connection
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        target = f"https://images.test:{listener.getsockname()[1]}/img.png"
        message = refusal(load_image, target, MediaPolicy(allowed_domains=("images.test",)), WHERE)
    assert message == f"could not fetch the image at {WHERE} ({target}): could not connect to the server"
    assert network.dialed == [PUBLIC_A] and network.asked == ["images.test"]
    assert handshakes == [("images.test", True, ssl.CERT_REQUIRED)]


def test_redirect_hops_are_resolved_checked_and_pinned(server, network):
    network.stand_ins.add(PUBLIC_A)  # images.test is "public" and served by the loopback server
    network.answers["images.test"] = [(PUBLIC_A,)]
    network.answers["inside.test"] = [("127.0.0.1",)]
    network.answers["rebind.test"] = [(PUBLIC_B,), ("127.0.0.1",)]
    policy = MediaPolicy(allowed_domains=("images.test", "inside.test", "rebind.test"))
    port = server.server_port
    before = len(server.seen)

    # A redirect to a name that resolves to loopback is refused before connecting.
    message = refusal(load_image, f"http://images.test:{port}/to/inside.test", policy, WHERE)
    assert message == (
        f"the image URL at {WHERE} redirects to http://inside.test:{port}/img.png, which is not allowed: "
        "the host 'inside.test' resolves to a private or loopback address"
    )
    # A redirect to a name that passes the check connects to the address checked, not a second lookup's.
    message = refusal(load_image, f"http://images.test:{port}/to/rebind.test", policy, WHERE)
    assert message == (
        f"could not fetch the image at {WHERE} (http://rebind.test:{port}/img.png): could not connect to the server"
    )
    assert network.dialed == [PUBLIC_A, PUBLIC_A, PUBLIC_B]
    assert network.asked == ["images.test", "inside.test", "images.test", "rebind.test"]
    assert [path for path, _ in server.seen[before:]] == ["/to/inside.test", "/to/rebind.test"]


def test_slow_resolver_gives_the_timeout_error(network):
    network.answers["slow.test"] = [(PUBLIC_A,)]
    network.slow.add("slow.test")  # answers only once the test is over (or after 20 s)
    policy = MediaPolicy(allowed_domains=("slow.test",), fetch_timeout_s=0.3)
    assert refusal(load_image, "http://slow.test/img.png", policy, WHERE) == (
        f"could not fetch the image at {WHERE} (http://slow.test/img.png): timed out"
    )
    # It gave up while the lookup was still pending, rather than waiting for it.
    assert network.asked == ["slow.test"] and network.answered == []
    assert network.dialed == []


def test_unresolvable_host(network, monkeypatch):
    policy = MediaPolicy(allowed_domains=("nowhere.test",))
    unresolved = f"could not fetch the image at {WHERE}: the host 'nowhere.test' could not be resolved"
    network.answers["nowhere.test"] = [()]  # an empty answer
    assert refusal(load_image, "http://nowhere.test/img.png", policy, WHERE) == unresolved

    def no_such_name(host, port, *args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_such_name)
    assert refusal(load_image, "http://nowhere.test/img.png", policy, WHERE) == unresolved
    assert network.dialed == []


# ---- file:// -------------------------------------------------------------------------------


@pytest.fixture
def roots(tmp_path: Path) -> tuple[Path, Path]:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "my picture.png").write_bytes(IMAGE_PNG)
    (root / "sub").mkdir()
    (outside / "secret.png").write_bytes(IMAGE_PNG)
    return root, outside


def test_local_file_under_root(roots):
    root, _ = roots
    policy = MediaPolicy(local_root=root)
    loaded = load_image((root / "my picture.png").as_uri(), policy, WHERE)  # %20 in the URL
    assert (loaded.format, loaded.source, loaded.image.size) == ("PNG", "file", (32, 24))
    (root / "link.png").symlink_to(root / "my picture.png")  # a symlink that stays inside is fine
    assert load_image((root / "link.png").as_uri(), policy, WHERE).source == "file"
    assert load_image(f"file://localhost{root}/my%20picture.png", policy, WHERE).format == "PNG"


def test_local_files_off_by_default(roots):
    root, _ = roots
    assert refusal(load_image, (root / "my picture.png").as_uri(), DEFAULT, WHERE) == (
        f"the image at {WHERE} is a file:// URL, but local files are off: "
        "start the server with --allowed-local-media-path to allow them"
    )


def test_local_file_outside_root_refused_like_a_missing_one(roots):
    root, outside = roots
    (root / "escape.png").symlink_to(outside / "secret.png")
    policy = MediaPolicy(local_root=root)
    attempts = {
        "dotdot": f"file://{root}/../outside/secret.png",
        "symlink": (root / "escape.png").as_uri(),
        "absolute": (outside / "secret.png").as_uri(),
        "missing": (root / "nope.png").as_uri(),
        "missing outside": (outside / "nope.png").as_uri(),
    }
    for name, target in attempts.items():
        message = refusal(load_image, target, policy, WHERE)
        expected = f"the image at {WHERE} ({target}) is not a readable file under --allowed-local-media-path"
        assert message == expected, name


def test_local_file_other_refusals(roots):
    root, _ = roots
    policy = MediaPolicy(local_root=root)
    assert "is not a regular file" in refusal(load_image, (root / "sub").as_uri(), policy, WHERE)
    assert "names a remote host" in refusal(load_image, "file://fileserver/share/a.png", policy, WHERE)
    assert "is not a readable file" in refusal(load_image, "file:relative.png", policy, WHERE)
    small = MediaPolicy(local_root=root, max_image_bytes=100)
    assert "is larger than the 100 byte limit" in refusal(load_image, (root / "my picture.png").as_uri(), small, WHERE)


# ---- count and policy ----------------------------------------------------------------------


def test_check_count():
    check_count(16, DEFAULT, "messages")
    message = refusal(check_count, 17, DEFAULT, "messages")
    assert message == "messages has 17 images; at most 16 are allowed in one request"
    check_count(1, MediaPolicy(max_images=1), "messages")
    with pytest.raises(MediaError):
        check_count(2, MediaPolicy(max_images=1), "messages")


@pytest.mark.parametrize(
    "fields",
    [
        {"max_images": 0},
        {"max_image_bytes": -1},
        {"max_image_pixels": 0},
        {"max_image_bytes": 1.5},
        {"fetch_timeout_s": 0},
        {"fetch_timeout_s": float("nan")},
        {"fetch_timeout_s": float("inf")},
        {"max_redirects": -1},
        {"allowed_domains": "example.com"},  # a string, not a tuple of names
        {"allowed_domains": ("http://example.com",)},
        {"allowed_domains": ("example.com:8080",)},
        {"allowed_domains": ("*",)},
        {"allowed_domains": ("a.*.example.com",)},
        {"allowed_domains": ("*.10.0.0.1",)},
        {"allowed_domains": ("",)},
        {"local_root": Path("/nonexistent/media/root")},
    ],
)
def test_policy_validation(fields):
    with pytest.raises(ValueError):
        MediaPolicy(**fields)


def test_policy_is_frozen_and_media_error_is_value_error():
    with pytest.raises(AttributeError):
        DEFAULT.max_images = 3
    assert issubclass(MediaError, ValueError)
    assert MediaPolicy(max_redirects=0).max_redirects == 0


def test_messages_name_no_internals(roots):
    root, _ = roots
    policy = MediaPolicy(local_root=root)
    messages = [
        refusal(decode_image, b"junk", policy, WHERE, "base64"),
        refusal(decode_image, IMAGE_PNG[:200], policy, WHERE, "base64"),
        refusal(load_image, "data:image/png;base64,!!!!", policy, WHERE),
        refusal(load_image, (root / "nope.png").as_uri(), policy, WHERE),
        refusal(load_image, "http://[::1/x", LOOPBACK, WHERE),
    ]
    for message in messages:
        assert WHERE in message
        for leak in ("Error", "Traceback", "Exception", "PIL", "site-packages", "httpx", "binascii"):
            assert leak not in message, (leak, message)
