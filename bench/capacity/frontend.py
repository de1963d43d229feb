"""A front end: one engine (AsyncLLM, its output loop and the feeding loop, as an ASR
actor is) in a process of its own, and the pipe the bench drives its phases through.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import math
import multiprocessing as mp
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from bench.capacity.ageing import (
    AGE_BULK,
    AGE_CONCURRENCY,
    AgeingBackend,
    aged_prompts,
    ageing_audio,
    ageing_frames,
    ageing_outputs,
    prefixed,
    stagger_tail,
    until_aged,
    until_first_sessions_aged,
)
from bench.capacity.ageing import (
    Session as AgedSession,
)
from bench.capacity.feed import FRAME, Handle, open_production, speech, track_sessions
from bench.capacity.phase import GPU_PROFILE_S, WARM_S, _phase
from bench.capacity.pinning import pin_cpus
from workers.engines import vad
from workers.engines.base import SessionOptions
from workers.engines.vllm.engine import (
    VllmEngineOptions,
    VllmVoxtralEngine,
    switch_lever,
)
from workers.events import AudioChunk


def stdout_to_stderr() -> None:
    """Send this process's stdout, and its children's, to stderr. A front end's vLLM (and
    its engine-core process) logs to stdout, and the front ends share the bench's, so its
    `--json` output began with a hundred log lines and was no JSON (H200, 2026-12-02)."""
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())


def _front_end(conn: Connection, options: VllmEngineOptions) -> None:
    stdout_to_stderr()
    asyncio.run(_front_end_async(conn, options))


async def _front_end_async(conn: Connection, options: VllmEngineOptions) -> None:
    engine = VllmVoxtralEngine(options)
    t = time.monotonic()
    try:
        await engine.start()
    except Exception as exc:  # the orchestrator reports it and stops
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
        return
    backend: Any = engine.backend
    llm = backend.llm
    audio = speech()
    import vllm
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.speech_to_text.realtime.serving import OpenAIServingRealtime

    serving = OpenAIServingRealtime(
        llm, OpenAIServingModels(llm, [BaseModelPath(name="voxtral", model_path=options.model)]),
        request_logger=None)
    direct_check: dict[str, Any] | None = None
    try:
        from workers.engines.vllm import direct as vllm_direct

        chunks = [audio[i * FRAME:(i + 1) * FRAME].astype(np.float32) / 32768.0
                  for i in range(60)]
        inputs = await _maybe_await(vllm_direct.check_equal(llm, backend.model_cls, chunks))
        generated = await vllm_direct.compare_generate(llm, backend.model_cls, chunks)
        direct_check = {"equal": bool(inputs.get("equal") and generated.get("tokens_equal")),
                        "inputs": inputs, "generate": generated}
    except Exception as exc:
        direct_check = {"equal": False, "error": f"{type(exc).__name__}: {exc}"}
    conn.send({"ready": True, "engine_start_s": round(time.monotonic() - t, 1),
               "vllm_version": vllm.__version__, "pid": os.getpid(),
               "direct_check": direct_check})

    async def gpu_profile() -> str | None:
        """vLLM's torch profiler in this engine core for GPU_PROFILE_S: the new trace."""
        folder = Path(options.torch_profiler_dir or ".")

        def traces() -> set[Path]:
            return set(folder.glob("*.pt.trace.json*"))

        before = await asyncio.to_thread(traces)
        try:
            await llm.start_profile()
            try:
                await asyncio.sleep(GPU_PROFILE_S)
            finally:
                await llm.stop_profile()
        except Exception as exc:  # the phase goes on; the report says no trace
            print(f"gpu profile failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return None
        new = await asyncio.to_thread(
            lambda: sorted(traces() - before, key=lambda p: p.stat().st_mtime))
        return str(new[-1]) if new else None

    async def ours(i: int, direct: bool) -> Handle:
        session = engine.open_session(SessionOptions(f"ours{i}", "auto"))
        session.direct_input = direct  # type: ignore[attr-defined]  # whatever auto chose
        pos = [0]

        async def drain() -> None:
            async for _ in session:
                pass

        d = asyncio.create_task(drain())

        def push(frame: np.ndarray) -> None:
            session.push_nowait(AudioChunk(f"ours{i}", pos[0], frame.tobytes(), time.time()))
            pos[0] += FRAME

        async def close() -> None:
            await session.aclose()
            d.cancel()

        return push, (lambda: session.outputs), close  # type: ignore[attr-defined]

    async def theirs(i: int) -> Handle:
        audio_q: asyncio.Queue[np.ndarray | None] = asyncio.Queue()
        count = [0]
        rid = [""]
        closing = [False]

        async def audio_gen() -> AsyncIterator[np.ndarray]:
            while (a := await audio_q.get()) is not None:
                yield a

        async def run() -> None:
            # A stock session ends at max_model_len; its client must open a new one on
            # the same audio (vLLM's server has no rollover of its own): so does this one.
            while not closing[0]:
                rid[0] = f"base-{i}-{uuid.uuid4().hex[:8]}"
                tokens: asyncio.Queue[list[int]] = asyncio.Queue()
                gen = llm.generate(prompt=serving.transcribe_realtime(audio_gen(), tokens),
                                   sampling_params=backend.sampling, request_id=rid[0])
                async for out in gen:
                    if out.outputs:
                        count[0] += 1
                        tokens.put_nowait(list(out.outputs[0].token_ids))
                stock_rollovers[0] += 1

        task = asyncio.create_task(run())

        async def close() -> None:
            closing[0] = True
            await llm.abort(rid[0])
            task.cancel()

        def push(frame: np.ndarray) -> None:
            # vLLM's realtime connection converts each PCM16 frame the same way.
            audio_q.put_nowait(frame.astype(np.float32) / 32768.0)

        return push, (lambda: count[0]), close

    stock_rollovers = [0]
    opened = track_sessions(engine)
    vad_box: list[Any] = []

    async def reanchor_counters() -> dict[str, Any]:
        return dict(await backend.reanchor_stats() or {})

    async def production(i: int) -> Handle:
        return await open_production(engine, vad_box[0], opened, i)

    aged_sessions: list[Any] = []
    age_gate: list[asyncio.Semaphore] = []

    async def aged(i: int, direct: bool, age_frames: int) -> Handle:
        every = engine.options.reanchor_every if engine.reanchoring else None
        if not age_gate:
            age_gate.append(asyncio.Semaphore(age_concurrency))
        s = AgedSession(backend, every, age_frames, AGE_BULK, audio,
                        (i * 7919 * FRAME) % audio.size, direct=direct, gate=age_gate[0])
        aged_sessions.append(s)

        def push(frame: np.ndarray) -> None:
            s.q.put_nowait(frame.astype(np.float32) / 32768.0)

        async def close() -> None:
            await s.close(backend)

        return push, (lambda: s.outputs), close

    async def all_aged() -> None:
        async def one(s: Any) -> None:
            waiter = asyncio.create_task(s.aged.wait())
            await asyncio.wait({waiter, s.task}, return_when=asyncio.FIRST_COMPLETED)
            if not s.aged.is_set():
                waiter.cancel()
                raise RuntimeError(f"an ageing session ended: {s.task.exception()!r}")

        await until_aged(asyncio.gather(*(one(s) for s in aged_sessions)),
                         lambda: sum(s.outputs for s in aged_sessions))

    while True:
        cmd = await asyncio.to_thread(conn.recv)
        if cmd["op"] == "stop":
            break
        path, n, seconds, first = cmd["path"], cmd["n"], cmd["seconds"], cmd["first"]
        controls = int(cmd.get("controls") or 0)
        tails_given: list[int] = []
        feed, age_frames = cmd.get("feed", "plain"), int(cmd.get("age_frames", 0))
        age_concurrency = int(cmd.get("age_concurrency", AGE_CONCURRENCY))
        direct = path == "direct"
        before: Callable[[], Awaitable[None]] | None = None
        # every phase says which spectrogram and token writes its engine core runs
        melspec = await switch_lever(backend, "set_melspec", bool(cmd.get("melspec")))
        tokens = await switch_lever(backend, "set_token_writes", bool(cmd.get("tokens")))
        trim = await switch_lever(backend, "set_window_trim", cmd.get("trim") or False)
        gather = await switch_lever(backend, "set_tick_gather", float(cmd.get("gather") or 0))
        if cmd.get("melspec") and not melspec.get("on"):
            conn.send({"error": f"sync-free spectrogram refused: {melspec.get('why_not')}"})
            continue
        if cmd.get("tokens") and not tokens.get("on"):
            conn.send({"error": f"incremental token writes refused: {tokens.get('why_not')}"})
            continue
        if cmd.get("trim") and trim.get("mode") != cmd.get("trim"):
            conn.send({"error": f"window-trimmed attention refused: {trim.get('why_not')}"})
            continue
        if cmd.get("gather") and not gather.get("on"):
            conn.send({"error": f"tick gather refused: {gather.get('why_not')}"})
            continue
        pin_at = tuple(cmd.get("pin_at") or (0, 1))
        try:  # before the phase's VAD helpers start: they inherit this process's CPUs
            pinned = pin_cpus(bool(cmd.get("pin")), *pin_at)
        except RuntimeError as exc:
            conn.send({"error": f"pinning refused: {exc}"})
            continue
        if path == "stock":
            starter: Callable[[int], Awaitable[Handle]] = theirs
        elif feed == "production":
            engine.direct_input = direct  # the manager's sessions take the engine's choice
            vad_box[:] = [vad.VadService(math.ceil(n / vad.STREAMS_PER_PROCESS))]

            async def starter(i: int) -> Handle:
                return await production(i)
        elif feed == "aged-production":
            # The production feed, its sessions aged first: the manager's first engine
            # session per stream starts with `age_frames` in bulk steps.
            engine.direct_input = direct
            vad_box[:] = [vad.VadService(math.ceil(n / vad.STREAMS_PER_PROCESS))]
            if not age_gate:
                age_gate.append(asyncio.Semaphore(age_concurrency))
            steps = age_frames // AGE_BULK
            sessions_aged = itertools.count()
            # Staggered (issue 34): session k of the whole phase (all front ends) takes
            # one more step of its share of a re-anchor cycle, so re-anchors spread over
            # the measured window; own tokens: the model's last output fed back.
            stagger = cmd.get("stagger") or {}
            own_tokens = bool(cmd.get("own_tokens"))
            aged_count = [0]  # sessions whose last large ageing step has its output

            def ageing(live: AsyncIterator[np.ndarray], tokens: asyncio.Queue[list[int]],
                       direct: bool, steps: int = steps,
                       count: Iterator[int] = sessions_aged, first: int = first,
                       stagger: dict[str, Any] = stagger, tails: list[int] = tails_given,
                       own_tokens: bool = own_tokens, aged_count: list[int] = aged_count,
                       ) -> AsyncIterator[Any]:
                k = next(count)  # sessions start at different places in the speech
                tail = (stagger_tail(first + k, int(stagger["total"]), int(stagger["every"]))
                        if stagger else 0)
                tails.append(tail)
                frames = ageing_audio(audio, (k * 7919 * FRAME) % audio.size,
                                      ageing_frames(steps, AGE_BULK, tail=tail))

                def aged() -> None:
                    aged_count[0] += 1

                return aged_prompts(backend, prefixed(frames, live), tokens, AGE_BULK, steps,
                                    direct, age_gate[0], tail=tail, own_tokens=own_tokens,
                                    on_aged=aged)

            ageing_wrapper = AgeingBackend(backend, ageing)
            engine._backend = ageing_wrapper
            opened.clear()

            async def starter(i: int) -> Handle:
                return await production(i)

            async def before(n: int = n + controls, steps: int = steps,
                             wrapper: AgeingBackend = ageing_wrapper,
                             aged_count: list[int] = aged_count,
                             stagger: dict[str, Any] = stagger) -> None:
                if not stagger:
                    await until_first_sessions_aged(opened, n, ageing_outputs(steps))
                else:  # ages differ: each session says when it is aged
                    async def all_there() -> None:
                        while aged_count[0] < n:  # noqa: ASYNC110
                            await asyncio.sleep(0.2)

                    await until_aged(all_there(), lambda: sum(
                        x[0].outputs for x in opened.values() if x))
                wrapper.open = False
        elif feed == "aged":
            aged_sessions.clear()
            before = all_aged

            async def starter(i: int, direct: bool = direct,
                              age_frames: int = age_frames) -> Handle:
                return await aged(i, direct, age_frames)
        else:
            async def starter(i: int, direct: bool = direct) -> Handle:
                return await ours(i, direct)
        segments: list[Callable[[], Awaitable[Any]]] = [
            functools.partial(set_levers, backend, lv, pin_at)
            for lv in cmd.get("segments") or []]

        async def sync() -> None:  # the orchestrator answers once every front end is here
            conn.send({"ready": True})
            go = await asyncio.to_thread(conn.recv)
            if go.get("op") != "go":
                raise RuntimeError(f"expected go, got {go!r}")

        try:
            profiled = cmd.get("profile") and options.torch_profiler_dir and path != "stock"
            result = await _phase(n, seconds, audio, starter, first, before,
                                  cmd.get("profile"), gpu_profile if profiled else None,
                                  segments=segments or None,
                                  sync=sync if cmd.get("sync") else None,
                                  controls=controls,
                                  control_speed=float(cmd.get("control_speed") or 0.97),
                                  counters=reanchor_counters if cmd.get("strict") else None,
                                  warm_s=float(cmd.get("warm_s") or WARM_S),
                                  deadline=cmd.get("deadline"),
                                  arrivals=cmd.get("arrivals") or "lockstep")
            if tails_given:
                result["age_tails_frames"] = tails_given
            if path == "stock":
                result["stock_rollovers"] = stock_rollovers[0]
            result["feed"] = "plain" if path == "stock" else feed
            result["melspec"] = bool(melspec.get("on"))
            result["token_writes"] = bool(tokens.get("on"))
            result["window_trim"] = trim.get("mode") or False
            result["pin"] = pinned
            conn.send(result)
        except Exception as exc:
            conn.send({"error": f"{type(exc).__name__}: {exc}"})
        finally:
            engine._backend = backend  # the aged-production feed's wrapper goes
            for service in vad_box:
                service.shutdown()
            vad_box.clear()
    await engine.aclose()
    conn.send({"stopped": True})


async def set_levers(backend: Any, levers: dict[str, Any],
                     pin_at: tuple[int, ...] = (0, 1)) -> dict[str, Any]:
    """Switch the engine core's four levers to `levers` (melspec, tokens: bool; trim:
    False, "blocks" or "keys"; gather: its window in ms, 0 off), and pinning (`pin`, this
    front end's slot of `pin_at`), and say what runs; a lever that will not switch fails
    the window (an A/B whose B did not run is no A/B)."""
    said: dict[str, Any] = {"pin": bool(pin_cpus(bool(levers.get("pin")), *pin_at))}
    for setter, key in (("set_melspec", "melspec"), ("set_token_writes", "tokens"),
                        ("set_window_trim", "trim")):
        want = levers.get(key) or False
        answer = await switch_lever(backend, setter, want)
        got = (answer.get("mode") or False) if key == "trim" else bool(answer.get("on"))
        if got != want:
            raise RuntimeError(f"{key} {want!r} refused: {answer.get('why_not')}")
        said[key] = got
    window = float(levers.get("gather") or 0)
    answer = await switch_lever(backend, "set_tick_gather", window)
    if window and not answer.get("on"):
        raise RuntimeError(f"gather {window!r} refused: {answer.get('why_not')}")
    said["gather"] = window if answer.get("on") else 0.0
    return said


async def _maybe_await(value: Any) -> Any:
    return await value if asyncio.iscoroutine(value) else value


class FrontEnd:
    """A front-end process and its pipe."""

    age_concurrency = AGE_CONCURRENCY

    def __init__(self, index: int, options: VllmEngineOptions) -> None:
        ctx = mp.get_context("spawn")
        self.index = index
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_front_end, args=(child, options), daemon=False)
        self.proc.start()
        self.info: dict[str, Any] = {}

    async def ready(self, timeout_s: float = 480.0) -> dict[str, Any]:
        if not await asyncio.to_thread(self.conn.poll, timeout_s):
            raise RuntimeError(f"front end {self.index} did not start in {timeout_s:.0f} s")
        self.info = self.conn.recv()
        if "error" in self.info:
            raise RuntimeError(f"front end {self.index}: {self.info['error']}")
        return self.info

    async def phase(self, path: str, n: int, seconds: float, first: int,
                    feed: str = "plain", age_frames: int = 0,
                    profile: str | None = None, melspec: bool = False,
                    tokens: bool = False, trim: bool | str = False, gather: float = 0.0,
                    segments: list[dict[str, Any]] | None = None,
                    barrier: asyncio.Barrier | None = None, pin: bool = False,
                    pin_at: tuple[int, int] = (0, 1), **strict: Any) -> dict[str, Any]:
        """One phase on this front end. `strict` (bench.capacity.strict): `strict`,
        `controls`, `control_speed`, `stagger` ({"total", "every"}), `own_tokens`,
        `warm_s`, `arrivals` (phase.ARRIVALS)."""
        self.conn.send({"op": "phase", "path": path, "n": n, "seconds": seconds,
                        "first": first, "feed": feed, "age_frames": age_frames,
                        "age_concurrency": self.age_concurrency, "profile": profile,
                        "melspec": melspec, "tokens": tokens, "trim": trim,
                        "gather": gather, "pin": pin, "pin_at": list(pin_at),
                        "segments": segments, "sync": barrier is not None, **strict})
        result: dict[str, Any] = await asyncio.to_thread(self.conn.recv)
        if barrier is not None and "ready" in result:  # aged: start the windows together
            with contextlib.suppress(asyncio.BrokenBarrierError):
                await barrier.wait()
            self.conn.send({"op": "go"})
            result = await asyncio.to_thread(self.conn.recv)
        elif barrier is not None:  # failed before its windows: the others must not wait
            await barrier.abort()
        if "error" in result:
            raise RuntimeError(f"front end {self.index} ({path}, {n}): {result['error']}")
        return result

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.send({"op": "stop"})
            await asyncio.to_thread(self.conn.poll, 60)
        await asyncio.to_thread(self.proc.join, 30)
        if self.proc.is_alive():
            self.proc.kill()
