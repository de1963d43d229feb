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
"""

from __future__ import annotations

import math
import os

REALTIME_STREAMS_PER_CORE = {"whisper-base": 1.5, "tiny.en": 3.0}


def default_streams_per_actor(model: str, cpu_threads: int, actors: int,
                              cores: int | None = None) -> int:
    """Streams per actor that the host's cores keep in real time for `model` (at least 1)."""
    host = cores if cores is not None else (os.cpu_count() or 1)
    usable = max(1, min(cpu_threads, host // max(1, actors)))
    per_core = REALTIME_STREAMS_PER_CORE.get(model, REALTIME_STREAMS_PER_CORE["whisper-base"])
    return max(1, math.floor(per_core * usable))
