"""Any OpenAI-compatible chat-completions endpoint as a translation backend
(`vllm serve` with an instruction-tuned model, a hosted API, ...)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import httpx

from translation.backends.base import BackendError
from translation.backends.chat import ChatTranslator


@dataclass(frozen=True, slots=True)
class OpenAIChatOptions:
    url: str
    """Base URL of the API, e.g. http://gpu-1:8000/v1 (`/chat/completions` is appended)."""
    model: str
    api_key_env: str | None = None
    """Name of the environment variable holding the API key (never the key itself)."""
    timeout_s: float = 10.0
    max_retries: int = 2
    batch_size: int = 16
    concurrency: int = 4
    temperature: float = 0.0


class OpenAIChatTranslator(ChatTranslator):
    name = "openai-chat"

    def __init__(self, options: OpenAIChatOptions) -> None:
        super().__init__(batch_size=options.batch_size, max_retries=options.max_retries,
                         concurrency=options.concurrency)
        self.options = options
        self._client: httpx.AsyncClient | None = None

    async def start(self) -> None:
        headers = {}
        if self.options.api_key_env:
            key = os.environ.get(self.options.api_key_env)
            if not key:
                raise BackendError(f"environment variable {self.options.api_key_env} "
                                   "(translation.openai.api_key_env) is not set")
            headers["Authorization"] = f"Bearer {key}"
        self._client = httpx.AsyncClient(base_url=self.options.url.rstrip("/"),
                                         headers=headers, timeout=self.options.timeout_s)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _complete(self, messages: list[dict[str, str]], max_tokens: int) -> str:
        if self._client is None:
            raise BackendError("openai-chat backend was not started")
        body = {"model": self.options.model, "messages": messages,
                "temperature": self.options.temperature, "max_tokens": max_tokens}
        resp = await self._client.post("/chat/completions", json=body)
        if resp.status_code >= 500 or resp.status_code == 429:
            # Transient: the retry loop tries again (not a BackendError).
            raise httpx.HTTPStatusError(f"server answered {resp.status_code}",
                                        request=resp.request, response=resp)
        if resp.status_code >= 400:
            raise BackendError(f"chat endpoint refused the request: HTTP {resp.status_code}")
        try:
            data: Any = resp.json()
            content = data["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise BackendError("chat endpoint answered outside the chat-completions "
                               "schema") from None
        if not isinstance(content, str):
            raise BackendError("chat endpoint answered with no text content")
        return content
