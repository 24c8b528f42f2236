"""Image input for chat requests: data: URIs, http(s) URLs and file:// URLs, decoded safely.

Every URL and every byte here comes from a client, so each step is capped before it
costs anything: the size of the encoded image before base64 decoding or reading a body,
the pixel count from the header before any pixel is decoded (decompression bombs),
the host, its addresses and every redirect before a connection is opened (SSRF), and
the resolved path before a file is opened (path escapes).

A URL's host is resolved once per hop, within the fetch's timeout, and the connection goes
to the addresses that were checked: httpx never resolves the name again, so a DNS server
that answers differently the second time (rebinding) cannot move the fetch inside the
network. The Host header, TLS SNI and certificate check still use the name.

A refusal is a `MediaError` whose message is meant for the client: it names the
request field (`where`) and what was wrong, never an exception class, a traceback or
a path on the server. The caller turns it into the protocol's 400.

Blocking (network, disk, decoding): callers run these functions in a worker thread.
This module imports no torch; the images it returns are Pillow RGB images.
"""

from __future__ import annotations

import base64
import io
import ipaddress
import math
import os
import re
import socket
import stat
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpcore
import httpx
from PIL import Image, UnidentifiedImageError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # Pillow's names; every other decoder stays off
MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF"}
_MEDIA_TYPE_OF_FORMAT = {fmt: media_type for media_type, fmt in MEDIA_TYPES.items()}
# data: URIs only: clients write image/jpg often enough that refusing it helps no one.
# Anthropic's media_type stays strict, as Anthropic's own API is.
_DATA_URI_MEDIA_TYPES = {**MEDIA_TYPES, "image/jpg": "JPEG"}
_FORMATS_IN_WORDS = "a PNG, JPEG, WebP or GIF image"

_REDIRECT_STATUSES = (301, 302, 303, 307, 308)
# No cookies, no auth, no compression: a compressed body would let a small download
# inflate past max_image_bytes inside one chunk.
_FETCH_HEADERS = {"User-Agent": "shoal", "Accept": "image/*", "Accept-Encoding": "identity"}

_ASCII_WHITESPACE = re.compile(r"[ \t\r\n\f\v]+")
# What Pillow raises on damaged input besides OSError (truncation) and ValueError; its own
# Image.open treats SyntaxError, IndexError, TypeError and struct.error as "not this format".
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, KeyError, struct.error)
_SHOWN_CHARS = 120  # a URL echoed in a message is cut to this


class MediaError(ValueError):
    """An image the request cannot use; the message is written for the client (an HTTP 400)."""


@dataclass(frozen=True)
class MediaPolicy:
    # Host names that http(s) images may come from (exact, case-insensitive; "*.example.com"
    # matches its subdomains, not example.com itself; an IP address only matches itself).
    # Empty: URL fetching is off, so a server never fetches for a client unless told to.
    allowed_domains: tuple[str, ...] = ()
    # Loopback, private, link-local, unspecified, multicast and reserved addresses are refused
    # unless True: an allowed name that resolves inside the network is still SSRF.
    allow_private_addresses: bool = False
    # --allowed-local-media-path: file:// URLs are read only under it, checked on the resolved
    # path (symlinks followed). None: local files are off.
    local_root: Path | None = None
    max_image_bytes: int = 20 << 20  # encoded bytes of one image: after base64 decoding, HTTP body, file size
    # width*height of one image, checked from the header before decoding. Pillow's own check
    # (Image.MAX_IMAGE_PIXELS) only raises at twice its value and is global, so we keep ours.
    max_image_pixels: int = 8192 * 8192
    max_images: int = 16  # images in one request (see check_count)
    fetch_timeout_s: float = 10.0  # one whole fetch: every hop's connect and body
    max_redirects: int = 3

    def __post_init__(self) -> None:
        if isinstance(self.allowed_domains, str):
            raise ValueError("allowed_domains must be a tuple of host names, not one string")
        object.__setattr__(self, "allowed_domains", tuple(_normalize_allowed_domain(d) for d in self.allowed_domains))
        if self.local_root is not None:
            root = Path(self.local_root)
            if not root.is_dir():
                raise ValueError(f"--allowed-local-media-path {root} is not a directory")
            object.__setattr__(self, "local_root", root)
        for name in ("max_image_bytes", "max_image_pixels", "max_images"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not (isinstance(self.max_redirects, int) and self.max_redirects >= 0):
            raise ValueError(f"max_redirects must be an integer >= 0, got {self.max_redirects!r}")
        if not (self.fetch_timeout_s > 0 and math.isfinite(self.fetch_timeout_s)):
            raise ValueError(f"fetch_timeout_s must be a positive number of seconds, got {self.fetch_timeout_s!r}")


@dataclass(frozen=True, eq=False)  # eq=False: comparing two of these must not compare every pixel
class LoadedImage:
    image: Image.Image  # RGB, fully loaded (no open file behind it)
    format: str  # "PNG" | "JPEG" | "WEBP" | "GIF": what the bytes were
    source: str  # "base64" | "url" | "file", for metrics and logs


def load_image(url: str, policy: MediaPolicy, where: str) -> LoadedImage:
    """An OpenAI image_url's url: a data: URI, an http(s) URL, or a file:// URL.

    Blocking (network, disk): callers run it in a worker thread.
    """
    if not isinstance(url, str) or not url:
        raise MediaError(f"the image at {where} has an empty URL")
    if url[:5].lower() == "data:":  # before urlsplit: a data: URI may be 27 MB of base64
        declared, payload = _split_data_uri(url, where)
        return _decode(_decode_base64(payload, policy, where), policy, where, "base64", declared)
    try:
        scheme = urlsplit(url).scheme.lower()
    except ValueError:
        raise MediaError(f"the image URL at {where} is not a valid URL") from None
    if scheme in ("http", "https"):
        return _decode(_fetch(url, policy, where), policy, where, "url", None)
    if scheme == "file":
        return _decode(_read_local_file(url, policy, where), policy, where, "file", None)
    described = f"the scheme '{_shown(scheme)}:'" if scheme else "no scheme"
    raise MediaError(
        f"the image URL at {where} has {described}: send a data: URI (base64), an http(s) URL or a file:// URL"
    )


def load_base64_image(data: str, media_type: str | None, policy: MediaPolicy, where: str) -> LoadedImage:
    """Anthropic's base64 source.

    media_type, if given, must be image/png, image/jpeg, image/webp or image/gif, and must
    match what the bytes are: a client that mislabels its images should hear about it.
    """
    declared = None
    if media_type is not None:
        declared = media_type.strip().lower()
        if declared not in MEDIA_TYPES:
            raise MediaError(
                f"the image at {where} has media_type '{_shown(media_type)}', which is not supported: "
                "use image/png, image/jpeg, image/webp or image/gif"
            )
    if not isinstance(data, str):
        raise MediaError(f"the image at {where} must be a base64 string")
    return _decode(_decode_base64(data, policy, where), policy, where, "base64", declared)


def decode_image(data: bytes, policy: MediaPolicy, where: str, source: str) -> LoadedImage:
    """Bytes -> a fully loaded RGB image; only PNG, JPEG, WebP and GIF.

    Animated GIF, WebP and PNG give their first frame. The pixel cap is checked from the
    header before any pixel is decoded; a truncated file, a non-image or a bomb is a MediaError.
    """
    return _decode(data, policy, where, source, None)


def check_count(n: int, policy: MediaPolicy, where: str) -> None:
    """Refuse a request with more than max_images images, before any of them is loaded."""
    if n > policy.max_images:
        raise MediaError(f"{where} has {n} images; at most {policy.max_images} are allowed in one request")


# ---- decoding -------------------------------------------------------------------------------


def _decode(data: bytes, policy: MediaPolicy, where: str, source: str, declared: str | None) -> LoadedImage:
    """decode_image, refusing early when the bytes are not the declared media type."""
    if len(data) > policy.max_image_bytes:
        raise MediaError(f"the image at {where} is larger than the {_bytes_in_words(policy.max_image_bytes)} limit")
    too_many_pixels = f"the image at {where} is larger than {_pixels_in_words(policy.max_image_pixels)}"
    try:
        # Lazy: reads the header only. Pillow's own DecompressionBombError (at twice its
        # global MAX_IMAGE_PIXELS) can fire here, before our cap is checked.
        opened = Image.open(io.BytesIO(data), formats=list(FORMATS))
    except UnidentifiedImageError:  # an OSError: before the generic handler
        raise MediaError(f"the image at {where} is not {_FORMATS_IN_WORDS}") from None
    except Image.DecompressionBombError:
        raise MediaError(too_many_pixels) from None
    except _DECODE_ERRORS:
        raise MediaError(f"the image at {where} is damaged: it could not be decoded") from None
    with opened:
        fmt = "JPEG" if opened.format == "MPO" else opened.format  # MPO: a phone's multi-picture JPEG
        if fmt not in FORMATS:
            raise MediaError(f"the image at {where} is not {_FORMATS_IN_WORDS}")
        if declared is not None and _DATA_URI_MEDIA_TYPES.get(declared) != fmt:
            raise MediaError(
                f"the image at {where} is declared as {declared} but is a {fmt} image ({_MEDIA_TYPE_OF_FORMAT[fmt]})"
            )
        width, height = opened.size
        if width <= 0 or height <= 0:
            raise MediaError(f"the image at {where} is damaged: it has no pixels")
        if width * height > policy.max_image_pixels:
            raise MediaError(
                f"the image at {where} is {width}x{height} pixels, larger than "
                f"{_pixels_in_words(policy.max_image_pixels)}"
            )
        try:
            rgb = _to_rgb(opened)
        except Image.DecompressionBombError:  # a later frame or a chunk larger than the header said
            raise MediaError(too_many_pixels) from None
        except _DECODE_ERRORS:  # with LOAD_TRUNCATED_IMAGES left False, truncation is an OSError here
            raise MediaError(f"the image at {where} is truncated or damaged: it could not be decoded") from None
    return LoadedImage(image=rgb, format=fmt, source=source)


def _to_rgb(image: Image.Image) -> Image.Image:
    """convert("RGB"), as transformers' processors do, except for 16-bit grey."""
    if image.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N"):
        # 16-bit grey PNG: convert("RGB") clips every value above 255 to white; scale instead.
        return image.convert("I").point(lambda value: value * (1 / 256)).convert("RGB")
    return image.convert("RGB")  # loads the (first) frame; a copy when already RGB


def _split_data_uri(url: str, where: str) -> tuple[str | None, str]:
    """data:[<media type>][;param]*;base64,<payload> -> (the declared image type or None, payload)."""
    comma = url.find(",")
    if comma < 0:
        raise MediaError(f"the image at {where} is a data: URI without a ',' before its data")
    params = [part.strip().lower() for part in url[5:comma].split(";")]
    if params[-1] != "base64" or len(params) < 2:
        raise MediaError(f"the image at {where} is a data: URI that is not base64: send data:image/png;base64,...")
    media_type = params[0]
    if not media_type.startswith("image/"):
        return None, url[comma + 1 :]  # text/plain, application/octet-stream, none: the bytes decide
    if media_type not in _DATA_URI_MEDIA_TYPES:
        raise MediaError(
            f"the image at {where} is {_shown(media_type)}, which is not supported: send {_FORMATS_IN_WORDS}"
        )
    return media_type, url[comma + 1 :]


def _decode_base64(text: str, policy: MediaPolicy, where: str) -> bytes:
    """Strict base64 (whitespace aside), refused from its length before decoding when too large."""
    compact = _ASCII_WHITESPACE.sub("", text)
    if not compact:
        raise MediaError(f"the image at {where} is empty")
    decoded_bytes = len(compact) // 4 * 3 - compact[-2:].count("=")  # exact for valid base64
    if decoded_bytes > policy.max_image_bytes:
        raise MediaError(f"the image at {where} is larger than the {_bytes_in_words(policy.max_image_bytes)} limit")
    try:
        return base64.b64decode(compact, validate=True)
    except ValueError:  # binascii.Error, or non-ASCII characters
        raise MediaError(f"the image at {where} is not valid base64") from None


# ---- http(s) --------------------------------------------------------------------------------


def _fetch(url: str, policy: MediaPolicy, where: str) -> bytes:
    """The body of an http(s) URL, following at most max_redirects redirects, each one re-checked.

    Every hop's host must be in allowed_domains and (unless allow_private_addresses) resolve
    only to public addresses; the hop then connects to those addresses and no others. The
    whole fetch, each hop's name resolution included, ends by fetch_timeout_s.
    """
    if not policy.allowed_domains:
        raise MediaError(
            f"the image at {where} is a URL, but URL fetching is off: "
            "start the server with --allowed-media-domains to allow it"
        )
    deadline = time.monotonic() + policy.fetch_timeout_s
    try:
        target = httpx.URL(url)
    except httpx.InvalidURL:
        raise MediaError(f"the image URL at {where} is not a valid URL") from None
    redirects = 0
    while True:
        refusal = _fetch_refusal(target, policy)
        addresses: tuple[str, ...] = ()
        if refusal is None:
            addresses = _resolve(target, where, deadline)
            if not policy.allow_private_addresses and not all(_is_public_address(a) for a in addresses):
                refusal = f"the host '{_shown(_host_of(target))}' resolves to a private or loopback address"
        if refusal is not None and redirects == 0:
            raise MediaError(f"the image URL at {where} is not allowed: {refusal}")
        if refusal is not None:
            raise MediaError(
                f"the image URL at {where} redirects to {_shown(str(target))}, which is not allowed: {refusal}"
            )
        body_or_next = _fetch_one_hop(target, addresses, policy, where, deadline)
        if isinstance(body_or_next, bytes):
            return body_or_next
        if redirects == policy.max_redirects:
            raise MediaError(
                f"could not fetch the image at {where} ({_shown(url)}): "
                f"it redirects more than {policy.max_redirects} times"
            )
        redirects += 1
        target = body_or_next


def _fetch_refusal(target: httpx.URL, policy: MediaPolicy) -> str | None:
    """Why this hop may not be fetched, judged from the URL alone, in words, or None."""
    if target.scheme not in ("http", "https"):
        return f"only http and https URLs can be fetched, not {_shown(target.scheme)}:"
    if target.userinfo:
        return "URLs with a user name or password are refused"
    host = _host_of(target)
    if not host:
        return "the URL has no host"
    if not _host_allowed(host, policy.allowed_domains):
        return f"the domain '{_shown(host)}' is not in --allowed-media-domains"
    return None


def _host_of(target: httpx.URL) -> str:
    return _normalize_host(target.raw_host.decode("ascii", "replace"))


def _resolve(target: httpx.URL, where: str, deadline: float) -> tuple[str, ...]:
    """The hop's addresses, in the resolver's order of preference, looked up once, by the deadline.

    getaddrinfo has no timeout of its own, so it runs in a daemon thread that is abandoned
    (it ends when the system resolver gives up) if the deadline passes first.
    """
    host = _host_of(target)
    if _is_ip(host):
        return (host,)
    port = target.port or (443 if target.scheme == "https" else 80)
    cannot = f"could not fetch the image at {where}: the host '{_shown(host)}' could not be resolved"
    answer: list[list | Exception] = []  # filled by the lookup thread, read only after it ended

    def lookup() -> None:
        try:
            answer.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except Exception as exc:  # handed to the waiting thread, which decides
            answer.append(exc)

    thread = threading.Thread(target=lookup, name="shoal-media-resolve", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if not answer:
        raise MediaError(f"could not fetch the image at {where} ({_shown(str(target))}): timed out")
    if isinstance(answer[0], (OSError, UnicodeError)):  # no such name, a resolver failure, a bad label
        raise MediaError(cannot) from None
    if isinstance(answer[0], Exception):
        raise answer[0]
    addresses = tuple(dict.fromkeys(str(info[4][0]) for info in answer[0]))  # dedup, order kept
    if not addresses:
        raise MediaError(cannot)
    return addresses


class _PinnedBackend(httpcore.SyncBackend):
    """Connects to the vetted addresses of one host, never to a fresh lookup of its name.

    httpcore hands connect_tcp the URL's host name; TLS (SNI and the certificate's name)
    happens afterwards on the stream, against that same name, so only the dial changes.
    """

    def __init__(self, host: str, addresses: tuple[str, ...], deadline: float) -> None:
        self._host = host
        self._addresses = addresses
        self._deadline = deadline

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        if _normalize_host(host) != self._host:  # one client per hop: nothing else should be asked for
            raise httpcore.ConnectError(f"this connection is pinned to {self._host}, not {host}")
        failure: Exception = httpcore.ConnectTimeout("the fetch deadline passed")
        for address in self._addresses:  # in order, like socket.create_connection over its own lookup
            remaining = self._deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                attempt = remaining if timeout is None else min(timeout, remaining)
                return super().connect_tcp(address, port, attempt, local_address, socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                failure = exc
        raise failure


class _PinnedTransport(httpx.HTTPTransport):
    """httpx's own transport over a connection pool that dials through a _PinnedBackend.

    HTTPTransport's request and response handling (and its mapping of httpcore's errors to
    httpx's) only use self._pool, so the pool is all this replaces; its __init__ is not
    called because building its default pool is all it does (the pinning tests in
    test_media.py fail if a later httpx stops working this way). Verification is httpx's
    default (certifi), without the environment's certificate settings.
    """

    def __init__(self, backend: _PinnedBackend) -> None:
        self._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(trust_env=False), network_backend=backend
        )


def _fetch_one_hop(
    target: httpx.URL, addresses: tuple[str, ...], policy: MediaPolicy, where: str, deadline: float
) -> bytes | httpx.URL:
    """One GET to the vetted addresses: the body on 2xx, the next URL on a redirect; else a MediaError."""
    failed = f"could not fetch the image at {where} ({_shown(str(target))})"
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise MediaError(f"{failed}: timed out")
    try:
        # A client per hop: no cookie a redirect sets is sent on, and its pool is pinned to this
        # hop's addresses. trust_env=False: no .netrc credentials (and a transport of our own
        # means no proxy from the environment, which would make the address check meaningless).
        transport = _PinnedTransport(_PinnedBackend(_host_of(target), addresses, deadline))
        with httpx.Client(
            transport=transport,
            follow_redirects=False,
            trust_env=False,
            timeout=httpx.Timeout(remaining),
            headers=_FETCH_HEADERS,
        ) as client:
            with client.stream("GET", target) as response:
                if response.status_code in _REDIRECT_STATUSES and "location" in response.headers:
                    try:
                        return response.url.join(response.headers["location"])
                    except httpx.InvalidURL:
                        raise MediaError(f"{failed}: it redirects to an invalid URL") from None
                if not 200 <= response.status_code < 300:
                    phrase = httpx.codes.get_reason_phrase(response.status_code)  # not the server's own text
                    raise MediaError(f"{failed}: the server answered HTTP {response.status_code} {phrase}".rstrip())
                return _read_body(response, policy, failed, deadline)
    except httpx.TimeoutException:
        raise MediaError(f"{failed}: timed out") from None
    except httpx.ConnectError:
        raise MediaError(f"{failed}: could not connect to the server") from None
    except httpx.InvalidURL:
        raise MediaError(f"{failed}: the URL is not valid") from None
    except httpx.HTTPError:  # protocol errors, a connection dropped mid-body
        raise MediaError(f"{failed}: the connection failed") from None


def _read_body(response: httpx.Response, policy: MediaPolicy, failed: str, deadline: float) -> bytes:
    """The raw body, stopped at max_image_bytes + 1 and at the fetch deadline."""
    too_large = f"{failed}: the image is larger than the {_bytes_in_words(policy.max_image_bytes)} limit"
    length = response.headers.get("content-length", "")
    if length.isdigit() and int(length) > policy.max_image_bytes:
        raise MediaError(too_large)
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise MediaError(f"{failed}: the server sent a compressed body (Content-Encoding: {_shown(encoding)})")
    body = bytearray()
    for chunk in response.iter_raw():
        body += chunk
        if len(body) > policy.max_image_bytes:
            raise MediaError(too_large)
        if time.monotonic() > deadline:  # each read has a timeout; a trickle needs this wall clock
            raise MediaError(f"{failed}: timed out")
    return bytes(body)


def _normalize_allowed_domain(entry: str) -> str:
    """An --allowed-media-domains entry in the form hosts are compared in; ValueError if malformed."""
    if not isinstance(entry, str):
        raise ValueError(f"allowed_domains entries must be strings, got {entry!r}")
    wildcard = entry.strip().startswith("*.")
    host = _normalize_host(entry.strip()[2:] if wildcard else entry.strip())
    if not host or any(c in host for c in "*/@?#% ") or (":" in host and not _is_ip(host)):
        raise ValueError(f"--allowed-media-domains entry {entry!r} is not a host name")
    if wildcard and _is_ip(host):
        raise ValueError(f"--allowed-media-domains entry {entry!r}: a wildcard cannot cover an IP address")
    if not host.isascii():
        try:
            host = host.encode("idna").decode("ascii")  # hosts are compared as sent: punycode
        except UnicodeError:
            raise ValueError(f"--allowed-media-domains entry {entry!r} is not a host name") from None
    return f"*.{host}" if wildcard else host


def _normalize_host(host: str) -> str:
    """Lower case, no trailing dot, no IPv6 brackets, IP addresses in their canonical form."""
    host = host.strip().lower().rstrip(".")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def _host_allowed(host: str, allowed_domains: tuple[str, ...]) -> bool:
    for entry in allowed_domains:
        if entry.startswith("*."):
            if host.endswith(entry[1:]) and not _is_ip(host):
                return True
        elif host == entry:
            return True
    return False


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _is_public_address(address: str) -> bool:
    """False for anything a server-side fetch must not reach without being told to."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 scope id (fe80::1%eth0)
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour  # ::ffff:127.0.0.1 reaches 127.0.0.1
        if embedded is not None and not _is_public_address(str(embedded)):
            return False
    refused = (
        ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_multicast or ip.is_reserved
    )
    return ip.is_global and not refused  # is_global also excludes shared space (100.64.0.0/10)


# ---- file:// --------------------------------------------------------------------------------


def _read_local_file(url: str, policy: MediaPolicy, where: str) -> bytes:
    """A file:// URL's bytes, only from under local_root (the resolved path: symlinks followed).

    A missing file and a file outside the root get the same message, so a client cannot
    probe what exists on the server.
    """
    if policy.local_root is None:
        raise MediaError(
            f"the image at {where} is a file:// URL, but local files are off: "
            "start the server with --allowed-local-media-path to allow them"
        )
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"the image URL at {where} names a remote host: a file:// URL must be file:///path")
    refused = MediaError(
        f"the image at {where} ({_shown(url)}) is not a readable file under --allowed-local-media-path"
    )
    raw_path = parts.path
    if not raw_path.startswith("/"):
        raise refused
    try:
        path = Path(unquote(raw_path, errors="strict")).resolve(strict=True)
    except (OSError, RuntimeError, ValueError):  # missing, a symlink loop, a NUL byte, bad %-escapes
        raise refused from None
    if not path.is_relative_to(policy.local_root.resolve()):
        raise refused
    not_a_file = MediaError(f"the image at {where} ({_shown(url)}) is not a regular file")
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # before opening: opening a device can have effects
            raise not_a_file
        # O_NOFOLLOW: the resolved path has no symlink left unless one was swapped in since.
        # O_NONBLOCK: a FIFO swapped in since the stat must not hang the open.
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
        with open(os.open(path, flags), "rb") as file:
            info = os.fstat(file.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise not_a_file
            if info.st_size > policy.max_image_bytes:
                raise MediaError(
                    f"the image at {where} is larger than the {_bytes_in_words(policy.max_image_bytes)} limit"
                )
            return file.read(policy.max_image_bytes + 1)  # + 1: a file grown since fstat is still caught
    except OSError:
        raise refused from None


# ---- words ----------------------------------------------------------------------------------


def _shown(text: str) -> str:
    """Client text echoed in a message: printable and short."""
    printable = "".join(c if c.isprintable() else "?" for c in text[: _SHOWN_CHARS + 1])
    return printable if len(printable) <= _SHOWN_CHARS else printable[:_SHOWN_CHARS] + "..."


def _bytes_in_words(n: int) -> str:
    if n % (1 << 20) == 0:
        return f"{n >> 20} MiB"
    if n % (1 << 10) == 0:
        return f"{n >> 10} KiB"
    return f"{n} byte"


def _pixels_in_words(n: int) -> str:
    side = math.isqrt(n)
    return f"{side}x{side} pixels" if side * side == n else f"{n} pixels"
