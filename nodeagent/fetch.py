"""Weights over HTTP(S): a model directory served at a URL base, so a P2P proxy (Dragonfly) or any object store
can feed every node of a launch at once instead of each one reading the same NFS share.

Layout: the manifest at ``<URL>/sha256sums.txt``, each file it lists at ``<URL>/<name>`` (names are plain file
names, `modelformat.parse_manifest`). `stage` streams each file into its ``.partial`` file in the agent's own shm
directory while hashing it; the manifest's sha256 is checked end to end, whatever path the bytes took.

Resumable: a download cut off (a dropped connection, a timeout, the agent killed or restarted) continues from
the bytes already in the ``.partial`` file with ``Range: bytes=N-``; a server that answers 200 instead of 206
(no Range support) sends the file again from the start, and a resumed file that does not hash to the manifest
is fetched once more from scratch (the partial bytes were of another version).

Blocking (urllib, one connection per file): the stager runs in threads. Proxies come from the usual
``http_proxy``/``https_proxy``/``no_proxy`` variables (what Dragonfly's dfdaemon proxy expects). Only
``http``/``https`` are spoken, redirects included: no ``file:``, ``ftp:`` or ``data:``. A redirect is followed only
to the URL's own origin (scheme, host and port; http -> https of the same host too) or to a host of
`FetchOptions.redirect_hosts` (an object store's presigned URLs, a CDN): a 302 to anywhere else (a loopback metadata
address, a node's own services) is refused and nothing is requested there. URLs are shown without credentials or
query strings (a presigned URL's signature is a secret).
"""

from __future__ import annotations

import hashlib
import http.client
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from nodeagent import modelformat
from nodeagent.errors import BadModel, StagingFailed

__all__ = ["FetchFailed", "FetchOptions", "UrlSource", "is_url", "shown"]

BLOCK_BYTES: Final = 4 * 2**20
"""Bytes read from the socket per write: large enough for full network speed, small enough for fine progress."""
MANIFEST_MAX_BYTES: Final = 4 * 2**20
"""A manifest is one line per file; anything bigger is not a manifest (and is not read into memory)."""
_RETRYABLE_STATUS: Final = frozenset({408, 425, 429, 500, 502, 503, 504})


class FetchFailed(StagingFailed):
    """A file could not be fetched from the model URL (after retries); the message says which, why and the fix.
    Its ``.partial`` bytes are kept: the next prewarm resumes from them."""


@dataclass(frozen=True)
class FetchOptions:
    timeout_s: float = 30.0
    """Connect and per-read timeout: a proxy that stalls this long is treated as a dropped connection (retried
    from where it stopped), not waited on forever."""
    retries: int = 5
    """Attempts after the first per file, each resuming where the last stopped: rides out a proxy restart or a
    peer going away mid-file, while a URL that is really wrong fails within a minute."""
    backoff_s: float = 0.5
    """First wait between attempts, doubled each time up to 8 s."""
    redirect_hosts: frozenset[str] = frozenset()
    """Hosts (``host`` or ``host:port``) a redirect may lead to besides the URL's own origin: the agent runs as
    root on GPU nodes, and a model URL's server must not be able to send it to any address it can reach."""


def is_url(source: str | os.PathLike[str]) -> bool:
    return str(source).startswith(("http://", "https://"))


def shown(url: str) -> str:
    """`url` fit for logs, status and errors: no user, password, query or fragment."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _origin(url: str) -> tuple[str, str, int]:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port or (443 if parts.scheme == "https" else 80)


class _NoUnsafeRedirects(urllib.request.HTTPRedirectHandler):
    """http(s) only, and only to the model URL's origin or an allowed host (see the module doc)."""

    def __init__(self, base: str, allowed: frozenset[str]) -> None:
        super().__init__()
        self.origin = _origin(base)
        self.allowed = frozenset(h.lower() for h in allowed)

    def allows(self, url: str) -> bool:
        scheme, host, port = _origin(url)
        if (scheme, host, port) == self.origin:
            return True
        if self.origin[0] == "http" and scheme == "https" and host == self.origin[1]:
            return True  # the same host, upgraded to TLS
        return host in self.allowed or f"{host}:{port}" in self.allowed

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: object,
        code: int,
        msg: str,
        headers: object,
        newurl: str,
    ) -> urllib.request.Request | None:
        if not is_url(newurl):
            raise urllib.error.URLError(f"redirect to a non-HTTP URL refused: {shown(newurl)}")
        if not self.allows(newurl):
            host = urllib.parse.urlsplit(newurl).netloc.rsplit("@", 1)[-1]
            raise urllib.error.URLError(
                f"redirect to another host refused: {shown(newurl)} (allow it with --fetch-redirect-host {host})"
            )
        return super().redirect_request(req, fp, code, msg, headers, newurl)  # type: ignore[arg-type]


def _opener(base: str, redirect_hosts: frozenset[str]) -> urllib.request.OpenerDirector:
    """HTTP(S) only: `build_opener` would add ``file:``, ``ftp:`` and ``data:`` handlers."""
    op = urllib.request.OpenerDirector()
    for handler in (
        urllib.request.ProxyHandler(),
        urllib.request.HTTPHandler(),
        urllib.request.HTTPSHandler(),
        _NoUnsafeRedirects(base, redirect_hosts),
        urllib.request.HTTPDefaultErrorHandler(),
        urllib.request.HTTPErrorProcessor(),
    ):
        op.add_handler(handler)
    return op


_NETWORK_ERRORS: Final = (OSError, http.client.HTTPException, urllib.error.URLError)


class UrlSource:
    """A model directory served at `url` (see the module doc)."""

    resumable = True
    """A cut-off download is continued with a Range request (see the module doc)."""

    def __init__(self, url: str, options: FetchOptions | None = None, *, sleep: Callable[[float], None] = time.sleep):
        if not is_url(url):
            raise BadModel(f"{shown(url)}: not an http:// or https:// URL")
        self.base = url if url.endswith("/") else url + "/"
        self.options = options or FetchOptions()
        self.shown = shown(url)
        self._opener = _opener(self.base, self.options.redirect_hosts)
        self._sleep = sleep
        self._sizes: dict[str, int] = {}

    def close(self) -> None:
        pass  # one connection per request, closed with it

    def url_of(self, name: str) -> str:
        return urllib.parse.urljoin(self.base, urllib.parse.quote(name))

    def _open(
        self, url: str, *, method: str = "GET", headers: dict[str, str] | None = None
    ) -> http.client.HTTPResponse:
        req = urllib.request.Request(url, method=method, headers={"User-Agent": "pulsescale-agent", **(headers or {})})
        resp: http.client.HTTPResponse = self._opener.open(req, timeout=self.options.timeout_s)
        return resp

    def _retrying(self, what: str, attempt: Callable[[], bytes]) -> bytes:
        last = ""
        for n in range(self.options.retries + 1):
            try:
                return attempt()
            except urllib.error.HTTPError as err:
                if err.code not in _RETRYABLE_STATUS:
                    raise FetchFailed(f"{what}: HTTP {err.code} {err.reason}; {_FIX}") from None
                last = f"HTTP {err.code} {err.reason}"
            except _NETWORK_ERRORS as err:
                last = _why(err)
            if n < self.options.retries:
                self._sleep(min(8.0, self.options.backoff_s * 2**n))
        raise FetchFailed(f"{what}: {last} ({self.options.retries + 1} attempts); {_FIX}")

    def manifest(self) -> dict[str, str]:
        url = self.url_of(modelformat.MANIFEST_FILE)

        def get() -> bytes:
            with self._open(url) as resp:
                body = resp.read(MANIFEST_MAX_BYTES + 1)
            if len(body) > MANIFEST_MAX_BYTES:
                raise BadModel(f"{shown(url)} is over {MANIFEST_MAX_BYTES} bytes: not a sha256sum manifest")
            return body

        body = self._retrying(f"GET {shown(url)}", get)
        try:
            text = body.decode()
        except UnicodeDecodeError as err:
            raise BadModel(f"cannot read {shown(url)}: {err}") from None
        return modelformat.parse_manifest(text, shown(url))

    def size(self, name: str) -> int:
        """The file's size from a HEAD request (0 when the server does not say: checked as it streams)."""
        if name not in self._sizes:
            url = self.url_of(name)

            def head() -> bytes:
                with self._open(url, method="HEAD") as resp:
                    return (resp.headers.get("Content-Length") or "0").encode()

            try:
                self._sizes[name] = int(self._retrying(f"HEAD {shown(url)}", head))
            except ValueError:
                self._sizes[name] = 0
        return self._sizes[name]

    def fetch(
        self,
        name: str,
        wfd: int,
        have: int,
        h: hashlib._Hash,
        on_bytes: Callable[[int], None],
    ) -> tuple[hashlib._Hash, int, int]:
        """Write `name` into `wfd` from byte `have` on (the first `have` bytes are there and hashed into `h`),
        retrying from where each attempt stopped. Returns the hash of the whole file, its size and the bytes
        received. A server that ignores the range restarts the file (`wfd` truncated, a fresh hash)."""
        url = self.url_of(name)
        what = f"GET {shown(url)}"
        at, received, last = have, 0, ""
        expect = self._sizes.get(name, 0)
        for n in range(self.options.retries + 1):
            try:
                headers = {"Range": f"bytes={at}-"} if at else {}
                try:
                    resp = self._open(url, headers=headers)
                except urllib.error.HTTPError as err:
                    if err.code == 416 and at and (not expect or at == expect):
                        return h, at, received  # all there already (a download killed before its rename)
                    raise
                with resp:
                    if at and resp.status != 206:
                        os.ftruncate(wfd, 0)  # no Range support: the whole file again
                        on_bytes(-at)
                        at, h = 0, hashlib.sha256()
                    elif at and not _range_starts_at(resp.headers.get("Content-Range"), at):
                        raise FetchFailed(
                            f"{what}: asked for bytes {at}- and got {resp.headers.get('Content-Range')!r}"
                        )
                    total = _total(resp, at)
                    if total:
                        expect = total
                    buf = bytearray(BLOCK_BYTES)
                    view = memoryview(buf)
                    while k := resp.readinto(buf):
                        h.update(view[:k])
                        done = 0
                        while done < k:
                            done += os.pwrite(wfd, view[done:k], at + done)
                        at += k
                        received += k
                        on_bytes(k)
                        if expect and at > expect:
                            raise FetchFailed(f"{what}: the server sent more than the {expect} bytes it announced")
                if expect and at < expect:
                    raise http.client.IncompleteRead(b"", expect - at)
                return h, at, received
            except FetchFailed:
                raise
            except urllib.error.HTTPError as err:
                if err.code not in _RETRYABLE_STATUS:
                    raise FetchFailed(f"{what}: HTTP {err.code} {err.reason}; {_FIX}") from None
                last = f"HTTP {err.code} {err.reason}"
            except OSError as err:
                if isinstance(err, (socket.timeout, ConnectionError)) or err.errno is None:
                    last = _why(err)
                else:
                    raise  # a local write failed (ENOSPC...): the caller says what it means
            except (http.client.HTTPException, urllib.error.URLError) as err:
                last = _why(err)
            if n < self.options.retries:
                self._sleep(min(8.0, self.options.backoff_s * 2**n))
        raise FetchFailed(
            f"{what}: {last} after {self.options.retries + 1} attempts ({at} bytes kept in the partial file; the "
            f"next prewarm resumes from there); {_FIX}"
        )


_FIX: Final = "check that the URL serves the model directory (sha256sums.txt and every file it lists) from this node"


def _why(err: BaseException) -> str:
    if isinstance(err, urllib.error.URLError) and not isinstance(err, urllib.error.HTTPError):
        reason = err.reason
        return f"cannot connect: {reason}" if isinstance(reason, OSError) else str(reason)
    if isinstance(err, socket.timeout | TimeoutError):
        return "timed out (no bytes within the timeout)"
    if isinstance(err, http.client.IncompleteRead):
        return f"connection closed {err.expected} bytes short of the end"
    return f"{type(err).__name__}: {err}"


def _range_starts_at(content_range: str | None, at: int) -> bool:
    """``bytes <at>-<end>/<total>``: the part asked for."""
    if not content_range or not content_range.startswith("bytes "):
        return False
    first = content_range[6:].split("-", 1)[0]
    return first.strip().isdigit() and int(first) == at


def _total(resp: http.client.HTTPResponse, at: int) -> int:
    """The whole file's size as the response says it (0: not said)."""
    cr = resp.headers.get("Content-Range")
    if resp.status == 206 and cr and "/" in cr:
        tail = cr.rsplit("/", 1)[1].strip()
        return int(tail) if tail.isdigit() else 0
    length = resp.headers.get("Content-Length")
    return int(length) + (at if resp.status == 206 else 0) if length and length.isdigit() else 0
