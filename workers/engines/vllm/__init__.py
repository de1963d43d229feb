"""The `vllm` engine: Voxtral Realtime on an in-process vLLM, one per GPU.

- `engine`: `VllmVoxtralEngine`, its AsyncLLM backend, the start sequence and health.
- `session`: `VllmVoxtralSession`, one stream's request (audio at the model's pace).
- `seams`: what a session takes from its engine and from vLLM (protocols only).
- `options`: options → engine args and the session arithmetic, without vLLM.
- `checks`: what the engine checks at start, before it takes a session.
- `direct`: each chunk's engine input built without vLLM's renderer.
- `mps`: whether CUDA MPS serves this GPU's engines.
- `reanchor/`: the re-anchoring plugin that vLLM loads by name in its engine core.

Nothing is imported here: importing `workers.engines.vllm.options` imports no vLLM.
"""
