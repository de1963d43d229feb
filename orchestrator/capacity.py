"""How many streams an embedded ASR actor takes when the event file does not say.

The embedded engine decodes every stream of an actor on one thread with `cpu_threads`
CPU threads; past a number of streams it no longer keeps real time (every stream's
captions fall behind together). `bench.scale` finds that knee; the figures here are its
measurements on the 2-core development machine, as real-time streams per core the actor
can use (its `cpu_threads`, at most the host's cores shared among the actors):

| model | knee, 2 cores | per core |
|---|---|---|
| whisper-base | 3 streams | 1.5 |
| tiny.en | 6 streams | 3.0 |

An operator who measures a bigger machine sets `engine.streams_per_actor` in the event file.

The `vllm` engine (Voxtral Realtime on vLLM 0.26.0) takes `VLLM_STREAMS_PER_ACTOR`, the knee
of `bench.voxtral_capacity` for sessions aged 30 minutes on an H200 (16-core Xeon host,
2026-12-01, the aged sessions fed to the engine directly): two engines on the GPU
(`engines_per_gpu: 2`, each 0.425 of its memory, bf16 KV cache, `max_model_len` 16384,
re-anchoring every 4096) held 36 aged sessions in real time, 18 per engine. The engine's
scheduler trace put an aged session at 78 KV blocks of 2,636 (65 for the decoder's
8,192-position window, 13 for the encoder's), so KV would allow ~33 per such engine. With
an fp8 KV cache and the sync-free spectrogram, 48 aged sessions fed through session
managers and VAD were real time (24 per engine; 64 not measured), but fp8 is not the
default. New sessions reach ≥ 128 per GPU (64 per engine), so the aged knee, 18 per
engine, is the budget. An engine that has the whole GPU (`engines_per_gpu: 1`) has about
twice the KV cache; it is given the same budget until its own aged knee is measured.
"""

from __future__ import annotations

import math
import os

REALTIME_STREAMS_PER_CORE = {"whisper-base": 1.5, "tiny.en": 3.0}
VLLM_STREAMS_PER_ACTOR = 18


def default_streams_per_actor(model: str, cpu_threads: int, actors: int,
                              cores: int | None = None) -> int:
    """Streams per actor that the host's cores keep in real time for `model` (at least 1)."""
    host = cores if cores is not None else (os.cpu_count() or 1)
    usable = max(1, min(cpu_threads, host // max(1, actors)))
    per_core = REALTIME_STREAMS_PER_CORE.get(model, REALTIME_STREAMS_PER_CORE["whisper-base"])
    return max(1, math.floor(per_core * usable))
