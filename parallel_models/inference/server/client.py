"""A small synchronous client for the rollout server (httpx; thread-safe, one connection pool)."""

from __future__ import annotations

from typing import Any, Sequence

from parallel_models.inference.sampling import SamplingParams


WIRE_PIECE_BYTES = 1 << 20


def wire_pieces(frames, piece_bytes: int = WIRE_PIECE_BYTES):
    """``frames`` (bytes-like) as zero-copy memoryview pieces of at most ``piece_bytes``.
    httpcore's sync write sends a chunk with ``buffer = buffer[sent:]``, which copies the rest of
    a ``bytes`` chunk after every ``send``: quadratic in the chunk size (a 512 MiB bucket as one
    chunk moved at ~30 MB/s; 1 MiB pieces at ~1 GB/s over loopback on 2 CPU cores)."""
    for frame in frames:
        view = memoryview(frame).cast("B")
        for start in range(0, len(view), piece_bytes):
            yield view[start:start + piece_bytes]


class ServerError(RuntimeError):
    """The server answered with an error status; ``status`` and ``message`` tell which."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def _answer(resp) -> dict:
    """The JSON body of a server response; a 4xx/5xx raises :class:`ServerError` with its
    ``error`` message (or the raw text when the body is not JSON)."""
    try:
        body = resp.json()
    except ValueError:
        body = {"error": resp.text}
    if resp.status_code >= 400:
        raise ServerError(resp.status_code, body.get("error", str(body)))
    return body


class RolloutClient:
    """``RolloutClient("http://127.0.0.1:8000", api_key=None, timeout=300.0)``."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 300.0):
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout,
                                  limits=httpx.Limits(max_connections=256,
                                                      max_keepalive_connections=64))

    def _call(self, method: str, path: str, json: Any = None) -> dict:
        return _answer(self._http.request(method, path, json=json))

    def health(self) -> dict:
        return self._call("GET", "/health")

    def info(self) -> dict:
        return self._call("GET", "/info")

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | None = None, *, return_text: bool = True,
                 return_routes: bool = False, prompt_seeds: Sequence[int] | None = None,
                 prompt_max_new_tokens: Sequence[int] | None = None,
                 **sampling: Any) -> dict:
        """POST /generate with ``params`` (or the :class:`SamplingParams` fields as keywords:
        ``n=4, max_new_tokens=32, temperature=0.7, seed=1, ...``; checked here first); returns
        ``{"weight_version", "results": [{"prompt_token_ids", "samples": [{"token_ids",
        "log_probs", "finish_reason", "text"?}]}]}``. ``prompt_seeds``: one seed per prompt, its
        samples' draws (``server/native_protocol.py``); ``prompt_max_new_tokens``: one
        response cap per prompt."""
        if params is None:
            params = SamplingParams(**sampling)
        elif sampling:
            params = params.model_copy(update=sampling)
        params.validate()
        body = {"prompts": [p if isinstance(p, str) else [int(t) for t in p] for p in prompts],
                **params.model_dump(), "return_text": return_text}
        if return_routes:  # MoE: each sample's "routes" (per token, per MoE layer, k experts)
            body["return_routes"] = True
        if prompt_seeds is not None:
            body["prompt_seeds"] = [int(s) for s in prompt_seeds]
        if prompt_max_new_tokens is not None:  # each prompt's own cap (<= max_new_tokens)
            body["prompt_max_new_tokens"] = [int(m) for m in prompt_max_new_tokens]
        return self._call("POST", "/generate", body)

    def update_weights(self, path: str) -> dict:
        """Load new weights from ``path`` (a folder the server can read); returns the new
        ``weight_version``."""
        return self._call("POST", "/update_weights", {"path": str(path)})

    def push_weight_stream(self, body) -> dict:
        """POST /update_weights_stream with ``body`` (an iterator of bytes-like frames,
        ``server/weight_stream.py``; handed to the socket in pieces of at most
        ``WIRE_PIECE_BYTES``, see :func:`wire_pieces`); returns the new ``weight_version``."""
        return _answer(self._http.post("/update_weights_stream", content=wire_pieces(body),
                                       headers={"content-type": "application/octet-stream"}))

    def weights_group(self, action: str, body: dict | None = None) -> dict:
        """``/weights_group/{action}``: ``init`` / ``update`` (POST ``body``) or ``status``
        (GET); ``server/weight_group.py``. 4xx / 5xx raise :class:`ServerError`."""
        if action == "status":
            return self._call("GET", "/weights_group/status")
        return self._call("POST", f"/weights_group/{action}", body)

    def shutdown(self) -> dict:
        return self._call("POST", "/shutdown")

    def close(self) -> None:
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
