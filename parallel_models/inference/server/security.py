"""Who may drive the rollout server: checks that run before any route (ASGI middleware).

A web page in the user's browser can send requests to a server on loopback (a form or a
``fetch`` with a "simple" content type needs no CORS preflight), and a DNS name that resolves
to 127.0.0.1 makes the page same-origin with it (DNS rebinding). So, in this order:

1. **Host** (400): the ``Host`` header must name the server: the loopback names on a loopback
   bind, the bound address, or one of ``--allowed-hosts`` (``*``: any). A wildcard bind
   (0.0.0.0, ::) without ``--allowed-hosts`` accepts any Host (its clients use names the server
   cannot know). The check of Starlette's ``TrustedHostMiddleware``, with IPv6 hosts and the
   server's JSON error body.
2. **Origin** (403): a browser's request carries ``Origin``; it is refused unless same-origin
   (the Origin's host:port is the Host asked for, e.g. the ``/docs`` page) or one of
   ``--allowed-origins`` (``*``: any; those also get CORS answers). Other clients send none.
3. **API key** (401): with ``--api-key``, ``Authorization: Bearer KEY`` on every endpoint but
   ``/health``, ``/docs``, ``/openapi.json``.
4. **Admin endpoints** (403): ``/shutdown``, ``/update_weights``, ``/update_weights_stream``
   and ``/weights_group/*`` are disabled unless an API key is set or ``--enable-admin`` is given
   on a loopback bind.
5. **Content type** (415): a POST with a body must say ``application/json`` (``/update_weights_
   stream``: ``application/octet-stream``); a page cannot send those without a CORS preflight.
   A POST without a body (``/shutdown``) needs none.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from urllib.parse import urlsplit

from parallel_models.errors import ConfigError
from parallel_models.inference.server.http_guards import auth_ok, error_response

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
OPEN_PATHS = ("/health", "/docs", "/openapi.json")
ADMIN_PATHS = ("/shutdown", "/update_weights", "/update_weights_stream")
STREAM_PATH = "/update_weights_stream"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback."""
    host = host.strip("[]").lower()
    if host in ("localhost",) or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    return host.strip("[]") in ("0.0.0.0", "::", "")


def is_admin_path(path: str) -> bool:
    return path in ADMIN_PATHS or path.startswith("/weights_group/")


def split_host_port(value: str) -> tuple[str, int | None]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port`` -> (lower-case host, port or None);
    ValueError when it is none of those."""
    value = value.strip()
    if not value:
        raise ValueError("empty host")
    if value.count(":") > 1 and not value.startswith("["):
        return value.lower(), None  # a bare IPv6 address
    parts = urlsplit("//" + value)
    host, port = parts.hostname, parts.port  # .port raises ValueError for a bad one
    if not host:
        raise ValueError(f"no host in {value!r}")
    return host, port


def _names(values) -> tuple[str, ...]:
    out = []
    for value in values:
        value = value.strip()
        if value:
            out.append(value.lower())
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class ServerSecurity:
    """The access settings of one server (``cli.py`` fills them from its flags)."""

    api_key: str | None = None
    bind_host: str = "127.0.0.1"
    enable_admin: bool = False
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    allowed_weight_peers: tuple[str, ...] = LOOPBACK_NAMES

    def __post_init__(self):
        if self.enable_admin and not self.api_key and not is_loopback(self.bind_host):
            raise ConfigError(f"--enable-admin: only on a loopback --host (got {self.bind_host}); "
                              "on other addresses give --api-key, which enables the admin "
                              "endpoints for its holders")
        for name, values in (("--allowed-hosts", self.allowed_hosts),
                             ("--allowed-weight-peers", self.allowed_weight_peers)):
            for value in values:
                if value != "*":
                    try:
                        split_host_port(value)
                    except ValueError:
                        raise ConfigError(f"{name}: {value!r} is not host or host:port") from None
        for origin in self.allowed_origins:
            if origin not in ("*", "null") and not urlsplit(origin).netloc:
                raise ConfigError(f"--allowed-origins: {origin!r} is not an origin "
                                  "(scheme://host[:port])")

    @property
    def admin_enabled(self) -> bool:
        return bool(self.api_key) or (self.enable_admin and is_loopback(self.bind_host))

    def host_allowed(self, header: str | None) -> bool:
        """Whether a request's ``Host`` header names this server."""
        allowed = _names(self.allowed_hosts)
        if "*" in allowed or (is_wildcard(self.bind_host) and not allowed):
            return True
        try:
            host, _ = split_host_port(header or "")
        except ValueError:
            return False
        if host in {split_host_port(h)[0] for h in allowed}:
            return True
        if host == self.bind_host.strip("[]").lower():
            return True
        return is_loopback(host) and (is_loopback(self.bind_host) or is_wildcard(self.bind_host))

    def origin_allowed(self, origin: str, host_header: str | None) -> bool:
        """Whether a browser request from ``origin`` may use the server."""
        origin = origin.strip().lower().rstrip("/")
        allowed = {o.lower().rstrip("/") for o in self.allowed_origins}
        if "*" in allowed or origin in allowed:
            return True
        return origin != "null" and urlsplit(origin).netloc == (host_header or "").lower()

    def peer_allowed(self, host: str, port: int) -> bool:
        """Whether the server may join a weights group hosted at ``host:port``."""
        host = host.strip("[]").lower()
        for entry in self.allowed_weight_peers:
            if entry == "*":
                return True
            peer, peer_port = split_host_port(entry)
            same = peer == host or (is_loopback(peer) and is_loopback(host))
            if same and peer_port in (None, port):
                return True
        return False


def _content_type_ok(path: str, headers: dict) -> str | None:
    """None when the body's content type fits ``path``, else what it must be."""
    ctype = headers.get(b"content-type")
    if ctype is None:
        empty = headers.get(b"content-length", b"0").strip() == b"0" and \
            b"transfer-encoding" not in headers
        want = "application/octet-stream" if path == STREAM_PATH else "application/json"
        return None if empty else want
    main = ctype.decode("latin-1").split(";")[0].strip().lower()
    if path == STREAM_PATH:
        return None if main == "application/octet-stream" else "application/octet-stream"
    kind, _, sub = main.partition("/")
    return None if kind == "application" and (sub == "json" or sub.endswith("+json")) else \
        "application/json"


class AccessGuard:
    """ASGI middleware applying a :class:`ServerSecurity` (see the module doc) before ``app``."""

    def __init__(self, app, security: ServerSecurity):
        self.app = app
        self.security = security

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self.refusal(scope)
        if refusal is not None:
            return await refusal(scope, receive, send)
        return await self.app(scope, receive, send)

    def refusal(self, scope):
        """The error response for this request, or None when it may go on."""
        sec, path = self.security, scope.get("path", "")
        headers = dict(scope.get("headers") or [])
        host = headers.get(b"host", b"").decode("latin-1")
        if not sec.host_allowed(host):
            return error_response(path, 400, f"Host {host!r} is not this server: use its "
                                  "address, or start it with --allowed-hosts NAME")
        origin = headers.get(b"origin")
        if origin is not None and not sec.origin_allowed(origin.decode("latin-1"), host):
            return error_response(path, 403, f"Origin {origin.decode('latin-1')!r} is not "
                                  "allowed: start the server with --allowed-origins ORIGIN")
        if (origin is not None and scope.get("method") == "OPTIONS"
                and b"access-control-request-method" in headers):
            return None  # an allowed Origin's CORS preflight (CORSMiddleware answers it)
        auth = headers.get(b"authorization")
        if path not in OPEN_PATHS and not auth_ok(auth and auth.decode("latin-1"), sec.api_key):
            return error_response(path, 401, "missing or wrong API key (Authorization: Bearer "
                                  "KEY)", code="invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"})
        if is_admin_path(path) and not sec.admin_enabled:
            return error_response(path, 403, f"{path} is an admin endpoint, disabled: start the "
                                  "server with --api-key KEY, or with --enable-admin on a "
                                  "loopback --host")
        if scope.get("method") == "POST":
            want = _content_type_ok(path, headers)
            if want is not None:
                return error_response(path, 415, f"Content-Type must be {want}")
        return None


def with_cors(app, security: ServerSecurity) -> None:
    """CORS answers (Starlette's ``CORSMiddleware``) for ``--allowed-origins``, if any."""
    if not security.allowed_origins:
        return
    from starlette.middleware.cors import CORSMiddleware

    app.add_middleware(CORSMiddleware, allow_origins=list(security.allowed_origins),
                       allow_methods=["GET", "POST"],
                       allow_headers=["Authorization", "Content-Type"])


__all__ = ["ADMIN_PATHS", "AccessGuard", "LOOPBACK_NAMES", "OPEN_PATHS", "ServerSecurity",
           "is_admin_path", "is_loopback", "split_host_port", "with_cors"]
