"""Re-anchoring for Voxtral Realtime sessions on stock vLLM, as a plugin.

A realtime session is one vLLM request that grows by one position per 80 ms of audio
and is capped by `max_model_len`. Every layer of the model attends through a sliding
window and encodes positions with RoPE alone, so positions that no window can see any
more can be dropped: at a chunk boundary the scheduler lowers the request's positions by
D (token history, computed-token count, head KV blocks, multimodal features) and the
worker re-rotates the live cached keys by R(−D). The session then runs for as long as
the event does, at a cost per chunk that no longer grows with its age.

- `rope`: the key re-rotation (plain torch).
- `plan`: the bookkeeping of one re-anchor on vLLM's scheduler objects (duck-typed).
- `scheduler`, `worker`: the vLLM classes that vLLM itself loads by qualified name
  (`scheduler_cls`, `worker_cls`) inside its engine-core process; nothing in this
  project imports them.
"""
