"""Ageing sessions: a session fed `age` minutes of audio in bulk prompts with blank (or
its own) tokens fed back, which builds the token history, positions, features and
KV that real-time decoding would, in seconds (bench.voxtral_age measures what such
sessions cost; the capacity bench measures how many of them one GPU holds), and the
production feed's sessions aged the same way.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np

from bench.capacity.feed import speech_frame

AGE_BULK = 768  # frames per ageing prompt, a multiple of ALIGN
AGE_CONCURRENCY = 8
"""Sessions of one front end in their bulk ageing steps at once (`--age-concurrency`):
each holds ~60 blocks of KV cache while a 768-frame step is in flight, ~78 once aged."""
AGE_STALL_S = 45.0
"""Ageing in which no session got a step for this long is stuck (e.g. waiting for KV
cache). Slow ageing that still moves goes on: four engines on one busy GPU aged 96
sessions for more than 150 s, which a fixed limit took for stuck."""

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


class AgeingBackend:
    """Bench-only: the engine's backend, except that while `open` every new session's
    prompts start with `ageing(audio, tokens, direct)`, which puts that session's age in
    front of its own audio (`aged_prompts`' bulk steps on the GPU). So the sessions a
    session manager opens are aged as production's would be after that long; a session
    opened after `open` is cleared (a restart, a rollover) is new, as in production."""

    def __init__(self, real: Any,
                 ageing: Callable[[AsyncIterator[np.ndarray], asyncio.Queue[list[int]], bool],
                                  AsyncIterator[Any]]) -> None:
        self._real = real
        self._ageing = ageing
        self.open = True
        self.aged_sessions = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def prompts(self, audio: AsyncIterator[np.ndarray],
                tokens: asyncio.Queue[list[int]]) -> AsyncIterator[Any]:
        return self._maybe_aged(audio, tokens, direct=False)

    def direct_prompts(self, audio: AsyncIterator[np.ndarray],
                       tokens: asyncio.Queue[list[int]]) -> AsyncIterator[Any]:
        return self._maybe_aged(audio, tokens, direct=True)

    def _maybe_aged(self, audio: AsyncIterator[np.ndarray], tokens: asyncio.Queue[list[int]],
                    direct: bool) -> AsyncIterator[Any]:
        if not self.open:
            real = self._real.direct_prompts if direct else self._real.prompts
            return real(audio, tokens)  # type: ignore[no-any-return]
        self.aged_sessions += 1
        return self._ageing(audio, tokens, direct)


async def prefixed(first: list[np.ndarray], rest: AsyncIterator[np.ndarray]
                   ) -> AsyncIterator[np.ndarray]:
    """The ageing audio, then the session's own."""
    for frame in first:
        yield frame
    async for frame in rest:
        yield frame


def ageing_audio(audio: np.ndarray, offset: int, frames: int) -> list[np.ndarray]:
    """`frames` 80 ms frames of the bench's speech as the model's buffer takes them."""
    return [speech_frame(audio, offset, k) for k in range(frames)]


async def until_first_sessions_aged(opened: dict[str, list[Any]], streams: int,
                                    outputs: int) -> None:
    """Every stream's first engine session has its ageing outputs (stalls: until_aged)."""
    def aged() -> bool:
        return len(opened) >= streams and all(
            sessions and sessions[0].outputs >= outputs for sessions in opened.values())

    async def all_there() -> None:
        # the sessions' counters move in the engine's tasks: there is no event to wait on
        while not aged():  # noqa: ASYNC110
            await asyncio.sleep(0.2)

    await until_aged(all_there(), lambda: sum(x[0].outputs for x in opened.values() if x))


async def until_aged(done: Awaitable[Any], steps: Callable[[], int],
                     stall_s: float = AGE_STALL_S, every_s: float = 1.0) -> None:
    """Await `done` while `steps()` (outputs of the ageing sessions) keeps growing; raise
    TimeoutError once it has not grown for `stall_s`."""
    task = asyncio.ensure_future(done)
    last, since = steps(), time.monotonic()
    try:
        while True:
            finished, _ = await asyncio.wait({task}, timeout=every_s)
            if finished:
                task.result()
                return
            now = steps()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= stall_s:
                raise TimeoutError(f"ageing stalled: no session got a step in {stall_s:.0f} s "
                                   f"({now} steps so far)")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
