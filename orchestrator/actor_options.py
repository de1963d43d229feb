"""Event config → the plain options of the floors below (ingest, ASR, translation hosts and
their engines): what the runtime hands each actor it makes. No Ray here."""

from __future__ import annotations

import logging
import os

from orchestrator.config import EventConfig, StreamConfig, TranslationConfig
from translation.backends import BackendSettings
from translation.backends.openai_chat import OpenAIChatOptions
from translation.backends.vllm_chat import VllmChatOptions
from translation.glossary import GlossaryTerm
from translation.host import TranslationHostOptions
from workers.engines.embedded import EmbeddedEngineOptions
from workers.engines.realtime_ws import RealtimeWsOptions
from workers.engines.vllm.engine import VllmEngineOptions
from workers.events import StreamOptions
from workers.sessions.manager import SessionPolicy
from workers.sessions.watchdog import RutPolicy

log = logging.getLogger(__name__)


def stream_options(s: StreamConfig, t: TranslationConfig | None = None) -> StreamOptions:
    t = t or TranslationConfig()
    return StreamOptions(
        stream_id=s.id,
        name=s.name,
        source=s.resolved_source,
        language=s.language,
        targets=tuple(s.targets),
        loop=s.loop,
        context_sentences=t.context_sentences,
        partials_every_s=t.partials_every_s,
        # The secret is read here, where the event starts (`babelcast run` has checked
        # that it is set), and travels to the ingest actor out of every repr.
        key=os.environ.get(s.key_env, "") if s.key_env else "",
        tls_cert=s.tls.cert if s.tls else "",
        tls_key=s.tls.key if s.tls else "",
        hls_start_segments=s.hls_start_segments,
    )


def session_policy(cfg: EventConfig) -> SessionPolicy:
    c = cfg.engine.session
    return SessionPolicy(
        budget_s=c.budget_s, margin_s=c.margin_s, overlap_s=c.overlap_s,
        switch_pause_s=c.switch_pause_s,
        rut=RutPolicy(window_s=c.rut_window_s, speech_s=c.rut_speech_s,
                      chars_per_speech_s=c.rut_chars_per_speech_s,
                      max_lag_s=c.rut_max_lag_s),
        stall_s=c.stall_s, stall_max_s=c.stall_max_s, dither_lsb=c.dither_lsb,
        max_fill_s=c.max_fill_s, shed_after_s=c.shed_after_s,
    )


def translation_backends(cfg: EventConfig) -> list[str]:
    """The concrete backends the event's pairs need (loaded when a translator starts)."""
    routes = cfg.translation.routing
    names = {routes.concrete_for(s.language, t) for s in cfg.streams for t in s.targets}
    return sorted(n for n in names if n is not None)


def translation_host_options(cfg: EventConfig, translator_id: str,
                             redis_url: str) -> TranslationHostOptions:
    t = cfg.translation
    openai = vllm = None
    if t.openai is not None:
        o = t.openai
        openai = OpenAIChatOptions(url=o.url, model=o.model, api_key_env=o.api_key_env,
                                   timeout_s=o.timeout_s, max_retries=o.max_retries,
                                   batch_size=o.batch_size, concurrency=o.concurrency)
    if t.vllm is not None:
        v = t.vllm
        vllm = VllmChatOptions(model=v.model, max_model_len=v.max_model_len,
                               gpu_memory_utilization=v.gpu_memory_utilization,
                               batch_size=v.batch_size)
    return TranslationHostOptions(
        translator_id=translator_id, redis_url=redis_url, routes=t.routing,
        backends=BackendSettings(openai=openai, vllm=vllm, timeout_s=t.timeout_s),
        glossary=tuple(GlossaryTerm(g.term, dict(g.translations), g.keep, g.case_sensitive)
                       for g in cfg.glossary),
        batch_size=t.batch_size, claim_idle_s=t.claim_idle_s, job_timeout_s=t.timeout_s,
    )


EngineOptions = EmbeddedEngineOptions | RealtimeWsOptions | VllmEngineOptions


def engine_options(cfg: EventConfig) -> EngineOptions:
    e = cfg.engine
    if e.kind == "vllm":
        v = e.vllm
        assert v is not None
        return VllmEngineOptions(
            model=e.model, max_streams=e.streams_per_actor, max_model_len=v.max_model_len,
            gpu_memory_utilization=round(v.gpu_memory_utilization / v.engines_per_gpu, 4),
            load_format=v.load_format,
            enforce_eager=v.enforce_eager, cudagraph_mode=v.cudagraph_mode,
            max_num_batched_tokens=v.max_num_batched_tokens, reanchor=v.reanchor,
            reanchor_every=v.reanchor_every, rollover_headroom=v.rollover_headroom,
            direct_input=v.direct_input, kv_cache_dtype=v.kv_cache_dtype,
            sync_free_melspec=v.sync_free_melspec,
            incremental_token_writes=v.incremental_token_writes,
            window_trim=v.window_trim, engines_per_gpu=v.engines_per_gpu,
            cuda_mps=v.cuda_mps, aligned_feed_ms=v.aligned_feed_ms,
            tick_gather_ms=v.tick_gather_ms,
            kv_cache_memory_bytes=(round(v.kv_cache_gib * 2**30) if v.kv_cache_gib else None),
        )
    if e.kind == "realtime-ws":
        assert e.url is not None
        token = os.environ.get(e.token_env, "").strip() or None if e.token_env else None
        return RealtimeWsOptions(url=e.url, model=e.model, delay_s=e.delay_s,
                                 max_session_s=e.max_session_s, token=token,
                                 text_lag_s=e.text_lag_s)
    return e.embedded_options()
