"""HTTP calls to a vLLM OpenAI-compatible server (standard library only: the trainer's
environment does not hold vLLM or an HTTP client package).

Each completion is its own request with its own seed: vLLM batches concurrent requests
itself, and one seed per row keeps a group's copies of a prompt from drawing the same
completion. Weights are reloaded through the development endpoints (the server is started
with ``VLLM_SERVER_DEV_MODE=1``): ``/pause``, ``/collective_rpc`` (``reload_weights``),
``/resume``.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

REQUEST_TIMEOUT_S = 600.0
PARALLEL_REQUESTS = 64


class ServerGone(ConnectionError):
    """The server did not answer (it died, or was never there)."""


@dataclass
class Completion:
    """One row's answer: new token ids, their log-probabilities, why it ended."""

    tokens: list[int]
    log_probs: list[float]
    finish_reason: str


class VLLMClient:
    """A vLLM server at ``url`` (``http://host:port``)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def _post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body or {}).encode()
        request = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:2000]
            raise RuntimeError(f"vLLM {path} answered {error.code}: {detail}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
            raise ServerGone(f"vLLM at {self.url} did not answer {path}: {error}") from None
        return json.loads(text) if text.strip() else None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def complete(
        self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], sampling: dict[str, Any]
    ) -> list[Completion]:
        """One completion per prompt (token ids), row ``i`` sampled with ``seeds[i]``."""

        def one(i: int) -> Completion:
            body = {"model": "temper", "prompt": list(prompts[i]), "seed": seeds[i], **sampling}
            choice = self._post("/v1/completions", body)["choices"][0]
            logprobs = choice["logprobs"]
            tokens = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
            return Completion(tokens, list(logprobs["token_logprobs"]), choice["finish_reason"])

        with ThreadPoolExecutor(min(PARALLEL_REQUESTS, max(1, len(prompts)))) as pool:
            return list(pool.map(one, range(len(prompts))))

    def reload_weights(self, folder: str) -> None:
        """Load the safetensors files of ``folder`` into the served model, between a pause
        (no request runs on half-loaded weights) and a resume. The prefix cache is reset:
        its KV entries were computed with the old weights, and a prompt seen before would
        otherwise decode from them."""
        self._post("/pause")
        try:
            self._post(
                "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": folder}},
            )
            self._post("/reset_prefix_cache")
        finally:
            self._post("/resume")
