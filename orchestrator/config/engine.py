"""The ASR engine pool: which engine, how many actors, failover and lag moves, the session
manager's policy, and the vllm engine's settings."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Self

from pydantic import Field, PrivateAttr, model_validator

from orchestrator.capacity import ALIGNED_FEED_MS
from orchestrator.config.base import _fail, _raise_at, _Strict
from workers.engines.vllm.reanchor.gather import MAX_WINDOW_MS

if TYPE_CHECKING:
    from workers.engines.embedded import EmbeddedEngineOptions


class SessionConfig(_Strict):
    """How the session manager keeps every stream captioned (rollover, watchdog, pacing)."""

    budget_s: float | None = Field(
        default=None, gt=0,
        description="audio seconds one engine session may take; null: the engine's own limit")
    margin_s: float = Field(default=30.0, gt=0,
                            description="start a warm rollover this long before the budget")
    overlap_s: float = Field(default=5.0, gt=0,
                             description="audio the new session re-reads before the switch")
    switch_pause_s: float = Field(default=0.25, gt=0,
                                  description="shortest pause a rollover may switch in")
    rut_window_s: float = Field(default=15.0, gt=0, description="rut watchdog window")
    rut_speech_s: float = Field(default=6.0, gt=0,
                                description="speech seconds without text that mean a rut")
    rut_chars_per_speech_s: float = Field(
        default=1.0, ge=0, description="below this many characters per speech second: a rut")
    rut_max_lag_s: float = Field(
        default=30.0, gt=0,
        description="seconds of speech fed to a session while its recognition does not move "
                    "at all (it stopped hearing) before the watchdog replaces it; a session "
                    "that is merely slow is never replaced (it is behind, not stuck)")
    shed_after_s: float | None = Field(
        default=None, gt=0, le=600,
        description="when a stream's captions fall this many seconds behind its audio, skip "
                    "to the live edge and say so: a `gap` event with the seconds skipped in "
                    "the captions and the archive (counted); null (default): keep every word "
                    "up to the input queue's size (~60 s), counting and logging what it drops")
    stall_s: float = Field(
        default=1.0, gt=0,
        description="source silence before dithered noise is fed; raised automatically up to "
                    "stall_max_s for transports that deliver in bursts (MPEG-TS, HLS)")
    stall_max_s: float = Field(default=3.0, gt=0,
                               description="the learned stall threshold never exceeds this")
    dither_lsb: int = Field(default=2, ge=1, le=64, description="noise amplitude in LSB")
    max_fill_s: float = Field(default=10.0, gt=0,
                              description="longer holes start a fresh session instead")

    @model_validator(mode="after")
    def _margin(self) -> Self:
        if self.budget_s is not None and self.margin_s >= self.budget_s:
            raise _fail(f"margin_s ({self.margin_s}) must be below budget_s ({self.budget_s})")
        if self.rut_speech_s > self.rut_window_s:
            raise _fail("rut_speech_s cannot exceed rut_window_s")
        if self.stall_max_s < self.stall_s:
            raise _fail(f"stall_max_s ({self.stall_max_s}) cannot be below stall_s "
                        f"({self.stall_s})")
        return self


class VllmConfig(_Strict):
    """AsyncLLM settings of the vllm engine (see VLLM.md); one engine per GPU actor."""

    max_model_len: int = Field(
        default=16384, ge=256,
        description="positions per session (× 80 ms = session cap without re-anchoring). "
                    "vLLM 0.26 reserves KV cache for one whole max_model_len request at "
                    "~1.1 MiB per position (the encoder's cache counts 4 frames per "
                    "position): 131072 needs 141 GiB and does not start on an H200; "
                    "re-anchoring keeps sessions within 16384")
    gpu_memory_utilization: float = Field(default=0.90, gt=0, le=1,
                                          description="share of GPU memory vLLM may take")
    engines_per_gpu: int = Field(
        default=1, ge=1, le=8,
        description="ASR actors (each a vLLM engine with its own front-end process) that "
                    "share one GPU; each takes gpu_memory_utilization / engines_per_gpu. Two "
                    "held more than one (one engine's per-chunk Python work bounded it); "
                    "three, with fp8 KV and window_trim's keys mode, held 104 sessions aged "
                    "30 min where two held 88; four no more new ones than two "
                    "(bench.voxtral_capacity, docs/gpu.md). Run CUDA MPS on the GPU node when "
                    "engines share a GPU: three at 112 aged made 12.15 frames/s per session "
                    "with it, 9.58 without (docs/gpu.md, CUDA MPS). These figures were "
                    "judged at 96 % of real time over seconds; by the strict keep-up rule "
                    "three under MPS kept 75 aged sessions up (docs/gpu.md, Budgets)")
    cuda_mps: bool = Field(
        default=False,
        description="the GPU nodes run CUDA MPS (their operator starts "
                    "`nvidia-cuda-mps-control -d` before Ray starts the actors): an engine "
                    "that MPS does not serve (no daemon answers, or its engine core is not "
                    "a client of the daemon's server) refuses to start instead of running "
                    "slower than its budget. With fp8 and three engines per GPU the default "
                    "streams_per_actor is 22 per engine under MPS with aligned_feed_ms on: by "
                    "the strict keep-up rule, sessions aged 12 min arriving spread over the "
                    "80 ms cycle, 25 per engine kept 75 of 75 up (2026-12-05, "
                    "bench/results/capacity_h200); 22 is 25 less 10 %. Without MPS, or with "
                    "aligned_feed_ms 0, 18 (docs/gpu.md, Budgets)")
    direct_input: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="build each 80 ms chunk's engine input directly instead of through "
                    "vLLM's renderer and HF processor: auto where the two were checked equal "
                    "byte for byte (vLLM 0.26.0 exactly); 12x less front-end CPU per chunk")
    load_format: Literal["mistral", "dummy", "babelcast_scaled"] = Field(
        default="mistral", description="mistral: real weights; dummy: random, every weight "
                    "in ±1e-3 (benchmarks); babelcast_scaled: random at a trained "
                    "checkpoint's scale, so attention depends on its keys (GPU tier)")
    enforce_eager: bool = Field(default=False, description="no CUDA graphs")
    cudagraph_mode: Literal["PIECEWISE", "NONE"] = Field(
        default="PIECEWISE", description="Voxtral refuses FULL graphs")
    max_num_batched_tokens: int | None = Field(
        default=None, ge=1, description="at least 400 × (streams + headroom) is used anyway")
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        default="auto", description="KV cache element type: auto (bf16) or fp8, half the GPU "
                                    "memory per position (sessions aged long are bounded by it)")
    sync_free_melspec: bool = Field(
        default=True,
        description="the encoder's spectrogram without a wait on the GPU per 80 ms chunk "
                    "(vLLM 0.26's makes a device tensor per chunk, which waits for the "
                    "stream); switched on only where it is bitwise equal to vLLM's. On the "
                    "H200 it took 48 sessions aged 30 min from 0 % to 100 % real time on "
                    "two engines (bench.voxtral_capacity +melspec, docs/gpu.md)")
    incremental_token_writes: bool = Field(
        default=True,
        description="stage a streaming session's token history on the GPU once instead of "
                    "again at every 80 ms chunk (vLLM 0.26's V2 runner rewrites it whole); "
                    "switched on only where a check on the GPU leaves the rows as vLLM's "
                    "writes would. On the H200 it took 56 sessions aged 30 min from 0 % to "
                    "100 % real time on two engines (bench.voxtral_capacity +tokens, docs/gpu.md)")
    window_trim: bool = Field(
        default=True,
        description="hand FlashAttention only the KV blocks each session's sliding window "
                    "can see (vLLM 0.26 hands it an aged session's whole position range, "
                    "and a slid window costs FA3 more); switched on only where a check on "
                    "the GPU finds the trimmed call as accurate as vLLM's. On the H200 it "
                    "took 88 sessions aged 30 min from 0 % to 96.6 % real time on two "
                    "engines, fp8, in one run (bench.voxtral_capacity +trim, docs/gpu.md). Its "
                    "'keys' mode (FA3's leftpad_k; taken where its check passes) runs an "
                    "aged decode step at the cost of 8,192 positions from the start: "
                    "1.38-1.81x vLLM's call on an aged decoder layer, fp8 (bench.fa_kernels "
                    "--trim)")
    aligned_feed_ms: int = Field(
        default=ALIGNED_FEED_MS, ge=0, le=1000, examples=[0],
        description="hand each caught-up session's 80 ms chunk to the model on one tick of "
                    "this many ms shared by the engine's sessions, so one engine-core step "
                    "carries them all, instead of a step per place in the cycle where streams "
                    "arrive (costs up to one tick of caption latency; a session behind is "
                    "never held); 0: as each arrives. On the H200 three engines under MPS "
                    "with arrivals spread over the cycle kept 60 and 75 sessions aged 12 min "
                    "up by the strict rule with 80 (bench/results/capacity_h200, 2026-12-05); "
                    "without it at those arrivals: not measured")
    tick_gather_ms: float = Field(
        default=0.0, ge=0, le=MAX_WINDOW_MS, examples=[5],
        description="on the tick (aligned_feed_ms), hold an idle engine's first step of a "
                    "tick up to this many ms until as many chunks wait as the last tick "
                    "carried, so one engine-core step takes them all instead of two (a busy "
                    "engine is never held; a late session costs at most this, once a tick); "
                    "0: off. One engine on an H100, 25 new sessions on the tick, 5 ms: one "
                    "step a tick instead of two, 1.94x less engine-core CPU per chunk, the "
                    "sessions' backlog 48 ms lower (bench/results/gather_h100, 2026-12-05). "
                    "What it is worth at the knee is not measured yet, so it is off by "
                    "default and the budgets do not count on it")
    kv_cache_gib: float | None = Field(
        default=None, gt=0, le=1024, examples=[30],
        description="each engine's KV cache, this many GiB (vLLM's kv_cache_memory_bytes), "
                    "instead of what a memory profile at start leaves under its share of "
                    "gpu_memory_utilization. Engines sharing a GPU then start side by side, "
                    "since no profile can be skewed by another engine loading: three on the "
                    "H200 started in 143 s at 30 GiB each, against 287 s one after another "
                    "(bench/results/capacity_h200, 2026-12-03 and 2026-12-04), and an engine "
                    "replaced after a fault need not wait for another's start. Weights, "
                    "activations and CUDA graphs still need their own memory beside it: "
                    "null (profile) unless the GPU's memory per engine is known")
    reanchor: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="keep sessions below max_model_len by re-anchoring their positions: auto "
                    "where tested (vLLM 0.26.0 exactly) and the engine's probe agrees; off: warm "
                    "rollovers before the cap")
    reanchor_every: int = Field(
        default=4096, ge=128, description="positions between a session's re-anchors")
    rollover_headroom: int | None = Field(
        default=None, ge=0,
        description="session slots beyond streams_per_actor for warm rollovers and restarts; "
                    "null: a quarter of streams_per_actor, at least 1")

    @model_validator(mode="after")
    def _gather_on_the_tick(self) -> Self:
        if self.tick_gather_ms and not self.aligned_feed_ms:
            _raise_at("VllmConfig", [(("tick_gather_ms",), (
                "gathers a tick's chunks, so it needs the tick: set aligned_feed_ms "
                "(80 by default) or remove this key"), self.tick_gather_ms)])
        return self

    @model_validator(mode="before")
    @classmethod
    def _no_delay(cls, data: Any) -> Any:
        # The delay is the model's (one engine per delay): a second copy here could only
        # disagree with it.
        if isinstance(data, dict) and "delay_ms" in data:
            _raise_at("VllmConfig", [(("delay_ms",), "the delay comes from the model "
                                      "folder's tekken.json (audio.transcription_delay_ms); "
                                      "remove this key", data["delay_ms"])])
        return data


class EngineConfig(_Strict):
    kind: Literal["embedded", "realtime-ws", "vllm"] = Field(
        default="embedded",
        description="speech engine: embedded (CPU Whisper), vllm (Voxtral Realtime on a GPU "
                    "per actor) or realtime-ws (a /v1/realtime server)")
    model: str = Field(
        default="whisper-base",
        description="embedded: whisper-base or tiny.en (English-only); vllm: the Voxtral model "
                    "folder; realtime-ws: the model name sent in session.update")
    url: str | None = Field(
        default=None, description="realtime-ws: ws(s):// URL of the /v1/realtime endpoint")
    delay_s: float = Field(default=0.48, ge=0,
                           description="realtime-ws: how far the server's text lags its audio")
    token_env: str | None = Field(
        default=None,
        description="realtime-ws: environment variable holding the token sent as "
                    "`Authorization: Bearer` (another Babelcast's publish token)")
    max_session_s: float | None = Field(
        default=None, gt=0,
        description="realtime-ws: the server's session cap in audio seconds, if known")
    text_lag_s: float = Field(
        default=0.0, ge=0, le=120,
        description="realtime-ws: seconds of speech the server may hear before it sends text "
                    "(0 for vLLM; about 25 for another Babelcast's /v1/realtime, which sends "
                    "a caption's text once it is final)")
    actors: int = Field(default=1, ge=1, description="number of ASR actors")
    failover_after_s: float = Field(
        default=1.0, ge=0.5, le=600,
        description="an ASR actor out of reach this long (dead for good: at once) has its "
                    "streams moved to other actors with room; they resume from their cursor")
    lease_ttl_s: float | None = Field(
        default=1.5, ge=0.5, le=60,
        description="each ASR actor keeps a lease in Redis with this expiry, renewed every "
                    "quarter of it (at most 0.5 s) while its engine works; the supervisor "
                    "moves the streams of an actor whose lease lapsed at once, without "
                    "waiting for Ray to notice a lost node (~18 s) or a frozen one (never); "
                    "null: no lease, Ray's signal and failover_after_s only")
    move_after_lag_s: float | None = Field(
        default=10.0, gt=0, le=600,
        description="a stream whose captions come more than this many seconds after the "
                    "speech, for move_lag_sustain_s, moves to another actor with room that is "
                    "not behind itself; it resumes from its cursor (null: never moves for lag)")
    move_lag_sustain_s: float = Field(
        default=10.0, ge=0, le=3600,
        description="how long a stream must stay behind move_after_lag_s before it moves")
    move_cooldown_s: float = Field(
        default=120.0, ge=0, le=86400,
        description="after a move for lag, the stream does not move for lag again, and the "
                    "actor it left takes no stream moved for lag, for this many seconds")
    streams_per_actor: int = Field(
        default=4, ge=1,
        description="streams one ASR actor decodes; unset: embedded engines take what the "
                    "host keeps in real time (calibrate: measured here; else per core), "
                    "raised to fit the event's streams with a warning, vllm the "
                    "budget for its KV type and engines per GPU (22 per engine for three "
                    "fp8 engines under MPS, from the strict keep-up rule; 18 or 36 "
                    "elsewhere, not yet re-measured by it; orchestrator/capacity.py, "
                    "docs/gpu.md), other engines 4")
    cpu_threads: int = Field(default=2, ge=1, description="CPU threads per ASR actor")
    step_s: float = Field(default=1.0, gt=0, description="seconds between re-decodes of a stream")
    pause_s: float = Field(default=0.6, gt=0, description="silence in seconds that ends a caption")
    final_pass: Literal["utterance", "agreement"] = Field(
        default="utterance",
        description="embedded: utterance: each final is one decode of the whole utterance at "
                    "a pause (most accurate); agreement: finals as two interim decodes agree")
    final_beam_size: int = Field(default=1, ge=1, le=10,
                                 description="embedded: beam of the final pass")
    final_prompt_words: int = Field(
        default=0, ge=0, le=224, examples=[20],
        description="embedded only, utterance mode: prompt each final pass with up to this "
                    "many words the stream committed before its audio (Whisper's "
                    "initial_prompt; a session keeps 224); 0: no prompt")
    final_context_s: float = Field(
        default=0.0, ge=0, le=28, examples=[5.0],
        description="embedded only, utterance mode: the final pass also reads up to this "
                    "many seconds of the (already final) audio before the utterance, while "
                    "the whole read fits Whisper's 30 s window, and drops the words it hears "
                    "there; 0: the utterance alone. Not read across a silence of more "
                    "than 2 s, and a pass that hears only its context is read again "
                    "without it (held-out speech: 8.7 % WER against the default's 8.3 %)")
    unfinished_pause_s: float | None = Field(
        default=None, gt=0, le=30, examples=[1.0],
        description="embedded only, utterance mode: a pause of pause_s ends an utterance "
                    "only where its newest interim ends a sentence, else it runs on until a "
                    "pause this long (longer than pause_s); null: every pause_s pause ends it")
    final_early_s: float = Field(
        default=0.3, ge=0, examples=[0.0],
        description="embedded only, utterance mode: start the final pass this many seconds "
                    "before a pause reaches pause_s, and commit it when the pause completes "
                    "(speech before then drops it: one decode spent); 0: start it when the "
                    "pause is whole")
    part_edge_s: float | None = Field(
        default=None, gt=0, le=10, examples=[1.0],
        description="embedded only, utterance mode: a sentence end the interims show inside "
                    "running speech is final once the audio is this many seconds past it and "
                    "an interim decoded then still shows it; shorter: earlier finals, and "
                    "more of Whisper's end-of-window periods taken at their word; null: "
                    "0.75 for English, 1.0 for other languages (bench.peer and bench.accuracy "
                    "lock step, 2026-12-05: English finals 0.26 s sooner at the same WER, for "
                    "~17 % more decoding per stream in the host calibration)")
    part_on_time: bool = Field(
        default=True, examples=[False],
        description="embedded only, utterance mode: decode that interim as soon as the audio "
                    "is part_edge_s past the sentence end; false: at the next interim step "
                    "(up to step_s later)")
    final_beam_max_busy: float | None = Field(
        default=None, ge=0, le=1, examples=[0.5],
        description="embedded only: the final pass uses final_beam_size only while the "
                    "decode thread was busy at most this fraction of the last 20 s, else "
                    "greedy (beam where there is headroom); null: always final_beam_size")
    calibrate: bool = Field(
        default=True,
        description="embedded only: each actor measures at start how many streams this "
                    "host keeps in real time with these options (a few seconds, once: cached "
                    "per host in $XDG_CACHE_HOME/babelcast/calibration.json) and reports it "
                    "in status; with streams_per_actor unset, the default is that figure "
                    "(babelcast run measures it before planning where none is cached); "
                    "false: the per-core estimate")
    session: SessionConfig = Field(default_factory=SessionConfig,
                                   description="session manager: rollover, rut watchdog, pacing")
    vllm: VllmConfig | None = Field(default=None, description="vllm engine settings")
    _host_carries: int | None = PrivateAttr(None)
    """Set when the embedded default (what this host carries) was below the event's
    streams per actor and the budget was raised to fit them (EventConfig): the figure."""

    def embedded_options(self) -> EmbeddedEngineOptions:
        """What an embedded engine gets from this section (the actors' engines, and the
        calibration looked up for the default streams per actor)."""
        from workers.engines.embedded import EmbeddedEngineOptions

        return EmbeddedEngineOptions(
            model=self.model, cpu_threads=self.cpu_threads, step_s=self.step_s,
            pause_s=self.pause_s, final_pass=self.final_pass,
            final_beam_size=self.final_beam_size, final_prompt_words=self.final_prompt_words,
            final_context_s=self.final_context_s, unfinished_pause_s=self.unfinished_pause_s,
            final_beam_max_busy=self.final_beam_max_busy, final_early_s=self.final_early_s,
            part_edge_s=self.part_edge_s, part_on_time=self.part_on_time,
            calibrate=self.calibrate)

    @model_validator(mode="before")
    @classmethod
    def _default_streams(cls, data: Any) -> Any:
        # Measured per engine (orchestrator/capacity.py): never past the knee. The vllm knee
        # reads the raw vllm section (before its defaults); the embedded one is set once its
        # fields are valid (_default_embedded_streams).
        if isinstance(data, dict) and data.get("streams_per_actor") is None:
            if data.get("kind") == "vllm":
                from orchestrator.capacity import vllm_streams_per_actor

                data = {**data, "streams_per_actor": vllm_streams_per_actor(data.get("vllm"))}
            elif data.get("kind", "embedded") == "embedded":
                data = {k: v for k, v in data.items() if k != "streams_per_actor"}
        return data

    @model_validator(mode="after")
    def _kind_fields(self) -> Self:
        if self.kind == "vllm" and self.vllm is None:
            self.vllm = VllmConfig()
        elif self.kind != "vllm" and self.vllm is not None:
            raise _fail("a vllm section needs engine kind vllm")
        if self.kind == "embedded" and self.model not in ("whisper-base", "tiny.en"):
            raise _fail(f"embedded engine model must be 'whisper-base' or 'tiny.en', "
                        f"got {self.model!r}")
        if self.kind == "realtime-ws":
            if not self.url or not self.url.startswith(("ws://", "wss://")):
                raise _fail("engine kind realtime-ws needs url: ws://HOST:PORT/v1/realtime")
        elif self.url is not None:
            raise _fail("url is only for engine kind realtime-ws")
        if self.token_env is not None and self.kind != "realtime-ws":
            raise _fail("token_env is only for engine kind realtime-ws")
        if self.kind != "embedded":
            _raise_at("EngineConfig", [
                ((k,), f"only for engine kind embedded (this engine is {self.kind}); "
                       "remove this key", getattr(self, k))
                for k in EMBEDDED_ONLY if k in self.model_fields_set])
        if self.final_early_s >= self.pause_s:
            _raise_at("EngineConfig", [(("final_early_s",), (
                f"must be shorter than pause_s ({self.pause_s}): the final pass starts "
                f"this long before the pause is whole"), self.final_early_s)])
        if (self.unfinished_pause_s is not None
                and self.unfinished_pause_s <= self.pause_s):
            _raise_at("EngineConfig", [(("unfinished_pause_s",), (
                f"must be longer than pause_s ({self.pause_s}): a pause of pause_s already "
                f"ends every utterance"), self.unfinished_pause_s)])
        return self

    @model_validator(mode="after")
    def _default_embedded_streams(self) -> Self:
        if self.kind != "embedded" or "streams_per_actor" in self.model_fields_set:
            return self
        from orchestrator.capacity import calibrated_streams_per_actor, default_streams_per_actor

        if self.calibrate:
            # The options the actor's engine gets, so the figure looked up is the one the
            # engine itself caches.
            self.streams_per_actor = calibrated_streams_per_actor(self.embedded_options(),
                                                                  self.actors)
        else:
            self.streams_per_actor = default_streams_per_actor(self.model, self.cpu_threads,
                                                               self.actors)
        # Still a default, not the operator's: a hot apply keeps the running budget when a
        # calibrated default moved since the start (orchestrator/apply.py).
        self.model_fields_set.discard("streams_per_actor")
        return self


EMBEDDED_ONLY = ("final_prompt_words", "final_context_s", "unfinished_pause_s",
                 "final_early_s", "part_edge_s", "part_on_time", "final_beam_max_busy",
                 "calibrate")
"""Engine keys that only the embedded engine reads: set with another kind, an error."""
