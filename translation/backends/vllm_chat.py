"""An instruction-tuned LLM on an in-process vLLM `AsyncLLM` (one GPU per translator
actor), with the same prompt, batching and parsing as `openai-chat`.

Thin on purpose: everything but the generate call is the shared code in `chat.py`
and `prompt.py`, which the tests exercise. `vllm` is imported lazily in `start`,
so this module imports (and the tests run) where vLLM is not installed. It has
not been run against a real model here: the lent GPU carries Voxtral only.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from translation.backends.base import BackendError
from translation.backends.chat import ChatTranslator


@dataclass(frozen=True, slots=True)
class VllmChatOptions:
    model: str
    """Model folder or name of an instruction-tuned chat model."""
    max_model_len: int = 8192
    gpu_memory_utilization: float = 0.85
    batch_size: int = 16
    concurrency: int = 8
    max_retries: int = 1


class VllmChatTranslator(ChatTranslator):
    name = "vllm"

    def __init__(self, options: VllmChatOptions) -> None:
        super().__init__(batch_size=options.batch_size, max_retries=options.max_retries,
                         concurrency=options.concurrency)
        self.options = options
        self._llm: Any = None
        self._tokenizer: Any = None
        self._sampling_cls: Any = None

    async def start(self) -> None:
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.sampling_params import SamplingParams
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise BackendError("translation backend 'vllm' needs the vllm package and a "
                               "GPU; use 'openai-chat' against a vllm server instead") from exc
        self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=self.options.model, max_model_len=self.options.max_model_len,
            gpu_memory_utilization=self.options.gpu_memory_utilization))
        self._tokenizer = await self._llm.get_tokenizer()
        self._sampling_cls = SamplingParams

    async def aclose(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    async def _complete(self, messages: list[dict[str, str]], max_tokens: int) -> str:
        if self._llm is None:
            raise BackendError("vllm backend was not started")
        prompt = self._tokenizer.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=True)
        params = self._sampling_cls(temperature=0.0, max_tokens=max_tokens)
        text = ""
        async for out in self._llm.generate(prompt, params, request_id=uuid.uuid4().hex):
            if out.finished:
                text = out.outputs[0].text
        return str(text)
