"""FAULT INJECTION for Ray tests: an ASR actor whose engine can be made to die on cue.

Its engine is the project's `vllm` engine over the FAKE vLLM backend (tests/fake_vllm.py;
vLLM cannot run here), so everything above the backend is the real code: sessions,
health, the ASR host, the Ray actor wrapper the runtime makes. `kill_engine()` does
what a crashed vLLM engine core does to the AsyncLLM client: it reports itself dead and
its requests fail. The GPU tier kills a real engine core (tests/gpu/).
"""

from __future__ import annotations

import os

from orchestrator.ray_actors import _HostActor
from tests.fake_vllm import FakeVllmBackend
from workers.asr import AsrHost, AsrHostOptions
from workers.engines.vllm.engine import DEFAULT_GEOMETRY, VllmEngineOptions, VllmVoxtralEngine


class FakeVllmAsrActor(_HostActor):
    def __init__(self, options: AsrHostOptions) -> None:
        super().__init__()
        self.backend = FakeVllmBackend(text_every=4)
        engine = VllmVoxtralEngine(VllmEngineOptions(model="/fake", max_streams=4),
                                   backend=self.backend, geometry=DEFAULT_GEOMETRY)
        self.host = AsrHost(options, engine)

    async def kill_engine(self) -> None:
        self.backend.errored = True
        self.backend.fail_after = 0

    async def pid(self) -> int:
        return os.getpid()
