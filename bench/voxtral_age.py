"""What a Voxtral session costs per 80 ms chunk as it ages, with and without re-anchoring,
on one GPU, in one run.

    python -m bench.voxtral_age --model DIR [--streams 16] [--age-min 0 30] --json

One AsyncLLM with the re-anchoring plugin. For each age and mode (`reanchor`: sessions
re-anchor every `--every` positions; `rollover`: stock sessions, as vLLM keeps them
until a rollover), `--streams` sessions are first aged — fed `age` minutes of audio in
bulk prompts of `--bulk` frames with blank tokens fed back, which builds the same token
history, positions, features and KV as real-time decoding would, in seconds instead of
minutes — then decoded at real-time pace for `--seconds`, and measured: CPU per chunk
of this process (vLLM's front end and the feeding loop) and of the engine-core process
(scheduler, model runner), frames/s per session, GPU utilisation. Phases alternate
between the modes, so neither gets the warm slot. `max_model_len` must hold the oldest
stock session (30 min = 22,500 positions).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.voxtral_capacity import _gpu_util, speech, speech_frame  # noqa: E402
from workers.engines.vllm.engine import VllmEngineOptions, VllmVoxtralEngine  # noqa: E402

FRAME = 1280
BLANK = 32
SETTLE_FRAMES = 2
FIRST_POSITIONS = 39
"""The first prompt's positions: BOS, 32 left-pad and 6 delay tokens (Voxtral's tekken.json)."""
ALIGN = 128
"""Bulk steps start at a multiple of this and are a multiple of it: the KV block unit a
re-anchor shifts by (lcm of the groups' block sizes: 128 for Voxtral, whose decoder blocks
are 128 positions). A re-anchor never cuts a feature's embeddings (plan.py); bulk features
off the unit straddle every allowed shift, and a session so aged never re-anchored."""


def lead_frames(align: int = ALIGN) -> int:
    """One-frame steps after the first prompt that bring the next step's start to a
    multiple of `align`."""
    return (-FIRST_POSITIONS) % align


BULK = 768


def tail_steps(tail: int, bulk: int = BULK) -> list[int]:
    """A tail of `tail` frames in steps no larger than a bulk step (a larger step would
    hold more KV cache until computed than any bulk step, see `aged_prompts`)."""
    return [bulk] * (tail // bulk) + ([tail % bulk] if tail % bulk else [])


def ageing_outputs(steps: int, align: int = ALIGN, tail: int = 0, bulk: int = BULK) -> int:
    """Outputs an ageing session has given once aged: the first prompt's, the lead's
    one-frame steps, the bulk steps and the tail's steps (if any)."""
    sized = steps + len(tail_steps(tail, bulk))
    return 1 + (lead_frames(align) + sized if sized else 0)


def stagger_tail(index: int, total: int, every: int, align: int = ALIGN) -> int:
    """Frames of session `index`'s (of `total`) tail step: its share of one re-anchor
    cycle (`every` positions), on the `align` unit, so `total` sessions aged alike but for
    their tails sit evenly over the cycle (32 places for 4096 positions) and re-anchor at
    evenly spread moments of a measured phase instead of in lockstep (issue 34)."""
    if total <= 0 or every < align:
        return 0
    places = every // align
    return ((index % total) * places // total) * align


def step_frames(k: int, lead: int, sizes: list[int]) -> int:
    """Frames of an ageing session's step `k` after its first prompt (k = 1, 2, …): the
    lead's one-frame steps, then `sizes` (the bulk steps and the tail's), then one."""
    return sizes[k - lead - 1] if lead < k <= lead + len(sizes) else 1


def ageing_frames(steps: int, bulk: int, align: int = ALIGN, tail: int = 0) -> int:
    """Audio frames an ageing session is given before its live audio: its first prompt
    with the look-ahead (8), the lead's one-frame steps, its bulk steps, and
    `SETTLE_FRAMES` one-frame steps.

    The one-frame steps let vLLM drop what the last bulk step holds outside the sliding
    windows: it frees those blocks only when it schedules the request again, and live
    audio comes only once every session has aged. Without them each aged session waited
    holding its last bulk step's encoder blocks (59 fp8 blocks where a session fed in real
    time holds 13), and 80 sessions on two engines filled one engine's cache while ageing
    (H200, 2026-12-01), a bound no production session meets."""
    return 8 + (lead_frames(align) if steps or tail else 0) + steps * bulk + tail \
        + SETTLE_FRAMES


class BulkPlace:
    """One session's place in the ageing gate: taken before its first bulk step, given
    back once the output of its last bulk step has come (its bulk KV is computed then),
    or when the session ends; given back once only.

    Not when its next one-frame step is built: that step waits for live audio, which
    both aged feeds send only after every session has aged, so sessions past the gate's
    size never got a place (H200, 2026-12-01: ageing stalled at 8 sessions x 33 steps,
    264 steps, on every front end)."""

    def __init__(self, gate: asyncio.Semaphore | None, bulk_steps: int, lead: int = 0) -> None:
        self.gate = gate if bulk_steps else None
        self.bulk_steps = bulk_steps  # the tail step, if any, counts as one more
        self.lead = lead
        self.holding = False

    async def before_step(self, step: int) -> None:
        """Step `step` (0: the first prompt, then `lead` one-frame steps, then the bulk
        ones) is about to go."""
        if self.gate is not None and step == self.lead + 1:
            await self.gate.acquire()
            self.holding = True

    def on_output(self, n: int) -> None:
        """The session's `n`-th output (1: the first prompt's) has come."""
        if n == self.lead + self.bulk_steps + 1:
            self.release()

    def release(self) -> None:
        if self.holding and self.gate is not None:
            self.holding = False
            self.gate.release()


async def aged_prompts(backend: Any, audio: AsyncIterator[np.ndarray],
                       tokens: asyncio.Queue[list[int]], bulk: int, bulk_steps: int,
                       direct: bool = False, gate: asyncio.Semaphore | None = None,
                       align: int = ALIGN, tail: int = 0,
                       own_tokens: bool = False,
                       on_aged: Callable[[], None] | None = None) -> AsyncIterator[Any]:
    """vLLM's realtime buffer (`VoxtralRealtimeBuffer`), except that after the first
    prompt and `lead_frames(align)` one-frame steps, `bulk_steps` steps take `bulk` frames
    at once (`bulk` a multiple of `align`, so each bulk step starts on it). With `direct`,
    the one-frame steps after them are built as the project's engine builds them
    (`workers/engines/vllm/direct.py`); the bulk steps always go through the renderer.

    `gate` bounds how many sessions are in their bulk steps at once: a bulk step holds the
    KV cache of `bulk` audio frames until it is computed (the encoder's ~4.5 x its window),
    and with every session ageing at once that filled an engine's cache and stalled it
    (48 sessions on two bf16 engines, H200), which no session fed in real time meets.

    `tail` (a multiple of `align`): that many more frames after the bulk steps, in steps
    of at most `bulk` (`tail_steps`), so sessions of one phase can be aged unlike each other
    (`stagger_tail`). `own_tokens`: each step is given the model's own last output token,
    as vLLM's realtime buffer does, where blank tokens were fed before; a bulk step's other
    positions, whose outputs no step computed, get blanks. `on_aged()` is called once
    the output of the session's last large step has come (it is aged)."""
    from vllm.engine.protocol import StreamingInput
    from vllm.model_executor.models.voxtral_realtime import VoxtralRealtimeBuffer
    from vllm.renderers.inputs.preprocess import parse_model_prompt
    from vllm.tokenizers import cached_tokenizer_from_config

    if bulk_steps and bulk % align:
        raise ValueError(f"bulk {bulk} is not a multiple of the alignment {align}")
    if tail % align or tail < 0:
        raise ValueError(f"tail {tail} is not a multiple of the alignment {align}")
    sizes = [bulk] * bulk_steps + tail_steps(tail, bulk)  # steps larger than one frame
    lead = lead_frames(align) if sizes else 0
    sized = len(sizes)
    llm = backend.llm
    model_config = llm.model_config
    tokenizer = cached_tokenizer_from_config(model_config)
    encoder = tokenizer.instruct.audio_encoder
    config = encoder.audio_config
    prompt_tokens = tokenizer.instruct.start() + encoder.encode_streaming_tokens()
    left_pad, _ = encoder.get_padding_audio()

    class Aged(VoxtralRealtimeBuffer):  # type: ignore[misc]
        def _generate_frame_size_and_num_tokens(self) -> Any:
            step = self._ms_to_samples(1000 / self._config.frame_rate)
            start, end, k = 0, self._initial_end, 0
            while True:
                frame_start = max(start - self._look_back_in_samples, 0)
                frame_end = end + self._look_ahead_in_samples
                yield frame_end - frame_start, (end - start) // step
                k += 1
                start = end
                end += step * step_frames(k, lead, sizes)

    buffer = Aged(config, prompt_tokens)
    build: Any = None
    if direct:
        from workers.engines.vllm.direct import DirectChunkBuilder

        if getattr(backend, "_direct", None) is None:
            backend._direct = DirectChunkBuilder.for_llm(llm)
        build = backend._direct.build

    async def feed_audio() -> None:
        await buffer.append_audio(left_pad.audio_array)
        async for chunk in audio:
            await buffer.append_audio(chunk)
        await buffer.append_audio(None)

    place = BulkPlace(gate, sized, lead)

    async def feed_tokens() -> None:
        n = 0
        while True:
            out = await tokens.get()
            n += 1
            place.on_output(n)
            if on_aged is not None and n == lead + sized + 1:
                on_aged()
            # Before a step of b frames the buffer needs b tokens: the model's own last
            # (own_tokens) and blanks, as silence gives, for positions no step decoded.
            b = step_frames(n, lead, sizes)
            own = out[-1:] if own_tokens and out else [BLANK]
            await buffer.append_tokens([*own, *[BLANK] * (b - 1)])

    tasks = [asyncio.create_task(feed_audio()), asyncio.create_task(feed_tokens())]
    step = 0
    try:
        async for s in buffer.get_input_stream():
            await place.before_step(step)
            step += 1
            engine_input = build(s.prompt) if build is not None else None
            if engine_input is None:
                (engine_input,) = await llm.renderer.render_cmpl_async(
                    [parse_model_prompt(model_config, s.prompt)])
            yield StreamingInput(prompt=engine_input)
    finally:
        place.release()
        for t in tasks:
            t.cancel()


class Session:
    def __init__(self, backend: Any, every: int | None, age_frames: int, bulk: int,
                 audio: np.ndarray, offset: int, direct: bool = False,
                 prefeed: bool = True, gate: asyncio.Semaphore | None = None) -> None:
        self.q: asyncio.Queue[np.ndarray | None] = asyncio.Queue()
        self.tokens: asyncio.Queue[list[int]] = asyncio.Queue()
        self.outputs = 0
        self.aged = asyncio.Event()
        self.rid = f"age-{uuid.uuid4().hex[:8]}"
        self.audio, self.offset = audio, offset
        self.fed = 0
        steps = age_frames // bulk if age_frames else 0
        self.aged_outputs = ageing_outputs(steps)  # first prompt, lead, bulk steps
        self.direct = direct
        self.gate = gate
        self.task = asyncio.create_task(self._run(backend, every, bulk, steps))
        for _ in range(ageing_frames(steps, bulk) if prefeed else 0):
            self.push()

    def push(self) -> None:
        self.q.put_nowait(speech_frame(self.audio, self.offset, self.fed))
        self.fed += 1

    async def _run(self, backend: Any, every: int | None, bulk: int, steps: int) -> None:
        async def audio() -> AsyncIterator[np.ndarray]:
            while (a := await self.q.get()) is not None:
                yield a

        prompts = aged_prompts(backend, audio(), self.tokens, bulk, steps, self.direct,
                               self.gate)
        async for out in backend.generate(prompts, self.rid, every):
            if out.outputs:
                self.outputs += 1
                if self.outputs >= self.aged_outputs:
                    self.aged.set()
                self.tokens.put_nowait(list(out.outputs[0].token_ids))

    async def close(self, backend: Any) -> None:
        await backend.abort(self.rid)
        self.task.cancel()


def _cpu(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def _core_pid() -> int:
    import os

    import psutil

    kids = psutil.Process(os.getpid()).children(recursive=True)
    named = [p.pid for p in kids if "EngineCore" in " ".join([*p.cmdline(), p.name()])]
    return int((named or [p.pid for p in kids])[0])


async def phase(backend: Any, mode: str, every: int, age_min: float, n: int, seconds: float,
                bulk: int, audio: np.ndarray) -> dict[str, Any]:
    age_frames = int(age_min * 60 / 0.08) // bulk * bulk
    sessions = [Session(backend, every if mode == "reanchor" else None, age_frames, bulk,
                        audio, (i * 7919 * FRAME) % audio.size) for i in range(n)]
    t_age = time.monotonic()
    await asyncio.gather(*(s.aged.wait() for s in sessions))
    aged_s = time.monotonic() - t_age
    core = _core_pid()
    stop = asyncio.Event()
    util: list[float] = []
    util_task = asyncio.create_task(_gpu_util(stop, util))
    warm, t0 = 2.0, time.monotonic()
    frames = int((seconds + warm) / 0.08)
    marks: dict[str, Any] = {}

    async def pace(s: Session) -> None:
        for k in range(frames):
            await asyncio.sleep(max(0.0, t0 + (k + 1) * 0.08 - time.monotonic()))
            s.push()

    async def mark() -> None:
        await asyncio.sleep(warm)
        marks["start"] = (time.monotonic(), time.process_time(), _cpu(core),
                          [s.outputs for s in sessions])

    await asyncio.gather(*(pace(s) for s in sessions), mark())
    t1, f1, c1 = time.monotonic(), time.process_time(), _cpu(core)
    t0m, f0, c0, o0 = marks["start"]
    decoded = sum(s.outputs for s in sessions) - sum(o0)
    stop.set()
    await util_task
    for s in sessions:
        await s.close(backend)
    fps = [(s.outputs - o) / (t1 - t0m) for s, o in zip(sessions, o0, strict=True)]
    return {
        "mode": mode, "age_min": age_min, "streams": n, "aged_in_s": round(aged_s, 1),
        "frames_per_s_p50": round(statistics.median(fps), 2),
        "realtime_streams": sum(1 for x in fps if x >= 12.0),
        "front_cpu_us_per_chunk": round((f1 - f0) / max(1, decoded) * 1e6),
        "core_cpu_us_per_chunk": round((c1 - c0) / max(1, decoded) * 1e6),
        "gpu_util": round(statistics.median(util), 1) if util else None,
    }


async def main_async(a: argparse.Namespace) -> dict[str, Any]:
    import vllm

    engine = VllmVoxtralEngine(VllmEngineOptions(
        model=a.model, max_streams=a.streams, max_model_len=a.max_model_len,
        load_format=a.load_format, gpu_memory_utilization=a.gpu_memory_utilization,
        reanchor="on", reanchor_every=a.every,
        max_num_batched_tokens=max(a.bulk * 2, 400 * a.streams)))
    t = time.monotonic()
    await engine.start()
    start_s = time.monotonic() - t
    audio = speech()
    backend: Any = engine.backend
    await phase(backend, "rollover", a.every, 0, a.streams, 4.0, a.bulk, audio)  # warm-up
    await phase(backend, "reanchor", a.every, 0, a.streams, 4.0, a.bulk, audio)
    results: list[dict[str, Any]] = []
    for i, age in enumerate(a.age_min):
        order = ("reanchor", "rollover") if i % 2 == 0 else ("rollover", "reanchor")
        for mode in order:
            results.append(await phase(backend, mode, a.every, age, a.streams, a.seconds,
                                       a.bulk, audio))
    counts = dict(engine.reanchor_counts)
    counts.pop("shift_by_request", None)
    await engine.aclose()
    return {"vllm_version": vllm.__version__, "engine_start_s": round(start_s, 1),
            "reanchoring": engine.reanchoring, "probe": engine.reanchor_probe,
            "every": a.every, "max_model_len": a.max_model_len, "seconds": a.seconds,
            "phases": results, "reanchor_stats": counts}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Voxtral model folder")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--age-min", type=float, nargs="+", default=[0.0, 30.0])
    ap.add_argument("--every", type=int, default=4096, help="positions between re-anchors")
    ap.add_argument("--bulk", type=int, default=768,
                    help=f"frames per ageing prompt (a multiple of {ALIGN})")
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    result = asyncio.run(main_async(a))
    print(json.dumps(result) if a.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
