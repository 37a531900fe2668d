"""A small synchronous client for the rollout server (httpx; thread-safe, one connection pool)."""

from __future__ import annotations

from typing import Any, Sequence


class ServerError(RuntimeError):
    """The server answered with an error status; ``status`` and ``message`` tell which."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


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
        resp = self._http.request(method, path, json=json)
        try:
            body = resp.json()
        except ValueError:
            body = {"error": resp.text}
        if resp.status_code >= 400:
            raise ServerError(resp.status_code, body.get("error", str(body)))
        return body

    def health(self) -> dict:
        return self._call("GET", "/health")

    def info(self) -> dict:
        return self._call("GET", "/info")

    def generate(self, prompts: Sequence[str | Sequence[int]], *, n: int = 1,
                 max_new_tokens: int = 16, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, greedy: bool = False, seed: int | None = None,
                 stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                 return_text: bool = True) -> dict:
        """POST /generate; returns ``{"weight_version", "results": [{"prompt_token_ids",
        "samples": [{"token_ids", "log_probs", "finish_reason", "text"?}]}]}``."""
        body = {"prompts": [p if isinstance(p, str) else [int(t) for t in p] for p in prompts],
                "n": n, "max_new_tokens": max_new_tokens, "temperature": temperature,
                "top_k": top_k, "top_p": top_p, "greedy": greedy, "seed": seed,
                "stop_token_ids": [int(t) for t in stop_token_ids], "ignore_eos": ignore_eos,
                "return_text": return_text}
        return self._call("POST", "/generate", body)

    def update_weights(self, path: str) -> dict:
        """Load new weights from ``path`` (a folder the server can read); returns the new
        ``weight_version``."""
        return self._call("POST", "/update_weights", {"path": str(path)})

    def shutdown(self) -> dict:
        return self._call("POST", "/shutdown")

    def close(self) -> None:
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
