"""HTTP guards of the rollout server, in front of both of its APIs: the request-body size limit
(ASGI middleware), the API-key check, the JSON body parser (strict JSON, valid Unicode, bounded
nesting) and error answers in the shape of the API a path belongs to (``{"error": message}`` for
the native endpoints, the OpenAI error body under ``/v1/``). Who may call which endpoint:
``security.py``.
"""

from __future__ import annotations

import hmac

from parallel_models.inference.server.openai_protocol import error_body


def is_openai(path: str) -> bool:
    """Whether ``path`` belongs to the OpenAI-compatible API."""
    return path == "/v1" or path.startswith("/v1/")


def error_response(path: str, status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict | None = None):
    """The error answer in the shape of the API ``path`` belongs to (OpenAI's under /v1/, where
    a validation error is a 400, not a 422)."""
    from starlette.responses import JSONResponse

    if is_openai(path):
        status = 400 if status == 422 else status
        return JSONResponse(error_body(status, message, param, code), status, headers=headers)
    return JSONResponse({"error": message}, status, headers=headers)


def auth_ok(header: str | None, api_key: str | None) -> bool:
    """``Authorization: Bearer KEY`` matches ``api_key`` (always true without a key)."""
    if not api_key:
        return True
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[7:].strip().encode(), api_key.encode())


class BadBody(ValueError):
    """A request body that is not the JSON this server reads (the message says why)."""


def _no_constant(name: str):
    raise BadBody(f"malformed JSON body: {name} is not a JSON value")


def parse_json_body(raw: bytes):
    """``raw`` as JSON: strict (no NaN / Infinity), nesting bounded by the parser's recursion
    limit, every string valid Unicode (no lone surrogate escape such as ``\\ud800``, which no
    tokenizer can encode); :class:`BadBody` otherwise."""
    import json

    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise BadBody("malformed JSON body: nested too deep") from None
    except (ValueError, UnicodeDecodeError) as exc:
        if isinstance(exc, BadBody):
            raise
        raise BadBody("malformed JSON body") from None
    stack = [data]
    while stack:  # iterative: the depth is whatever the parser accepted
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise BadBody("the body has a string with a lone surrogate escape (e.g. "
                              "\\ud800): not valid Unicode") from None
    return data


class BodyLimit:
    """ASGI middleware: 413 for bodies over the limit (Content-Length or streamed)."""

    def __init__(self, app, max_bytes: int, unlimited_paths: tuple[str, ...] = ()):
        self.app = app
        self.max_bytes = max_bytes
        self.unlimited_paths = unlimited_paths  # streamed as they come (weight pushes)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in self.unlimited_paths:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        path = scope.get("path", "")
        too_big = error_response(path, 413, f"request body over {self.max_bytes} bytes")
        if length is not None:
            try:
                if int(length) > self.max_bytes:
                    return await too_big(scope, receive, send)
            except ValueError:
                bad = error_response(path, 400, "bad Content-Length")
                return await bad(scope, receive, send)
        if length is not None:
            return await self.app(scope, receive, send)
        # no Content-Length (chunked): read the body here, up to the limit, then replay it
        chunks, seen, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                return  # client went away
            chunks.append(msg.get("body", b""))
            seen += len(chunks[-1])
            more = msg.get("more_body", False)
            if seen > self.max_bytes:
                return await too_big(scope, receive, send)
        body = b"".join(chunks)
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


__all__ = ["BadBody", "BodyLimit", "auth_ok", "error_response", "is_openai", "parse_json_body"]
