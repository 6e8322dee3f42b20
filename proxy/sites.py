"""Which web sites may talk to the server: no cross-site requests, no DNS rebinding.

A page the user visits can make the browser send requests to http://127.0.0.1:8421, and a DNS name the page
controls can resolve to 127.0.0.1 (rebinding), after which the browser even reads the answers. Agents send
no Origin and a Host naming the loopback; a browser always sends the page's Origin on a cross-site POST and
the name it resolved as Host. So:

- an Origin, when sent, must be a loopback origin (any port) or one of `--allow-origin`;
- on a loopback bind, the Host must name the loopback (localhost, 127.0.0.0/8, [::1]; any port) or be one of
  `--allow-host`. On other binds clients name the server as they like, and only the Origin is checked.

"*" in either list allows anything. A refusal is a 403 in the route's error shape, before authentication.

A page that may call the server gets what a browser needs to let it (CORS): its preflight (OPTIONS with
Access-Control-Request-Method) answered 204 before authentication, since a browser sends no key with it,
allowing the method and the headers it asks for (authorization, x-api-key, anthropic-*); and every answer to it,
errors and streams too, names its Origin as allowed and exposes the response headers (x-killick-*, retry-after).
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

from aiohttp import web

from proxy.errors import ApiError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class Sites:
    origins: frozenset[str] = frozenset()  # allowed besides loopback ones: "scheme://host[:port]", or "*"
    hosts: frozenset[str] = frozenset()  # Host names allowed besides loopback ones (no port), or "*"
    check_host: bool = True  # a loopback bind

    @classmethod
    def for_bind(cls, bind_host: str, origins=(), hosts=()) -> "Sites":
        return cls(frozenset(_origin_key(o) for o in origins), frozenset(h.lower().strip("[]") for h in hosts),
                   check_host=is_loopback(bind_host))

    def refusal(self, origin: str | None, host: str | None) -> str | None:
        """Why a request with these Origin and Host headers is refused, or None."""
        if origin is not None and "*" not in self.origins and not self._origin_ok(origin):
            return f"Origin {origin!r} may not use this server (start it with --allow-origin {origin} to allow it)"
        if self.check_host and host is not None and "*" not in self.hosts and not self._host_ok(host):
            return (f"Host {host!r} is not this loopback server (a DNS rebinding page?); start it with "
                    "--allow-host NAME to allow another name")
        return None

    def _origin_ok(self, origin: str) -> bool:
        return _origin_key(origin) in self.origins or is_loopback(_hostname(origin))

    def _host_ok(self, host: str) -> bool:
        name = _hostname("//" + host)
        return name is not None and (name in self.hosts or is_loopback(name))


def is_loopback(name: str | None) -> bool:
    if not name:
        return False
    if name.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


def _hostname(url: str) -> str | None:
    try:
        return urlsplit(url).hostname  # lower case, IPv6 brackets removed
    except ValueError:
        return None


def _origin_key(origin: str) -> str:
    return origin.strip().rstrip("/").lower()


ALLOWED_ORIGIN = web.RequestKey("killick_allowed_origin", str)  # a page's Origin this request came from
METHODS = "GET, HEAD, POST, DELETE, OPTIONS"
PREFLIGHT_MAX_AGE_S = 600


def sites_middleware(sites: Sites):
    @web.middleware
    async def check_site(request: web.Request, handler):
        origin = request.headers.get("Origin")
        why = sites.refusal(origin, request.headers.get("Host"))
        if why is not None:
            raise ApiError(403, why, code="forbidden_origin")
        if origin is None:
            return await handler(request)
        request[ALLOWED_ORIGIN] = origin
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            return web.Response(status=204, headers={
                "Access-Control-Allow-Methods": METHODS, "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
                "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers", "")})
        return await handler(request)

    return check_site


async def cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: an answer to an allowed page names its Origin (and varies by it), so the browser
    lets the page read it, a stream or an error alike."""
    origin = request.get(ALLOWED_ORIGIN)
    if origin is not None:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Expose-Headers"] = "*"
        response.headers.add("Vary", "Origin")
