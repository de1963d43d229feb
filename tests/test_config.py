"""Event YAML → models: defaults, and errors that point at file, line and key."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from orchestrator.capacity import (
    ALIGNED_FEED_MS,
    REALTIME_STREAMS_PER_CORE,
    VLLM_FP8_STREAMS_PER_ACTOR,
    VLLM_FP8_X3_MPS_ALIGNED_STREAMS_PER_ACTOR,
    VLLM_FP8_X3_MPS_STREAMS_PER_ACTOR,
    VLLM_FP8_X3_STREAMS_PER_ACTOR,
    VLLM_STREAMS_PER_ACTOR,
    default_streams_per_actor,
)
from orchestrator.config import (
    ConfigError,
    ConfigIssue,
    EngineConfig,
    EventConfig,
    GatewayConfig,
    IngestConfig,
    RayConfig,
    RedisConfig,
    StreamConfig,
    VllmConfig,
    load_event,
    parse_event,
)

pytestmark = pytest.mark.unit


def write(tmp_path: Path, text: str, name: str = "event.yaml") -> Path:
    (tmp_path / "room-a.flac").write_bytes(b"fLaC")  # existence is all the loader checks
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def issues_of(path: Path) -> list[ConfigIssue]:
    with pytest.raises(ConfigError) as info:
        load_event(path)
    return info.value.errors


def only_issue(path: Path) -> ConfigIssue:
    issues = issues_of(path)
    assert len(issues) == 1, issues
    return issues[0]


MINIMAL = """\
event: "Demo conference"
streams:
  - id: room-a
    source: room-a.flac
"""


def test_minimal_config_loads_with_defaults(tmp_path: Path) -> None:
    cfg = load_event(write(tmp_path, MINIMAL))
    assert isinstance(cfg, EventConfig)
    assert cfg.event == "Demo conference"
    assert cfg.redis.url is None
    assert cfg.ray.address is None and cfg.ray.num_cpus is None
    e = cfg.engine
    assert (e.kind, e.model, e.actors) == ("embedded", "whisper-base", 1)
    assert e.streams_per_actor == default_streams_per_actor("whisper-base", 2, 1)
    assert (e.cpu_threads, e.step_s, e.pause_s) == (2, 1.0, 0.6)
    assert (e.final_pass, e.final_beam_size) == ("utterance", 1)
    assert cfg.ingest.actors == 1
    assert (cfg.gateway.host, cfg.gateway.port) == ("127.0.0.1", 8000)
    s = cfg.streams[0]
    assert (s.id, s.name, s.loop, s.language, s.targets) == ("room-a", "room-a", False, "auto", [])


def test_full_config_resolves_sources_and_kinds(tmp_path: Path) -> None:
    path = write(tmp_path, """\
event: Demo
redis: {url: "redis://127.0.0.1:6379/0"}
ray: {address: auto}
engine: {actors: 2, streams_per_actor: 2}
streams:
  - {id: room-a, name: Room A, source: room-a.flac, loop: true, language: en,
     targets: [fr, pt]}
  - {id: file-url, source: "file://room-a.flac"}
  - {id: hall, source: "rtmp://host/live/key", language: "no"}
  - {id: srt-in, source: "srt://0.0.0.0:9000"}
gateway: {port: 0}
""")
    cfg = load_event(path)
    kinds = [(s.source_kind, s.resolved_source) for s in cfg.streams]
    local = str((tmp_path / "room-a.flac").resolve())
    assert kinds == [("file", local), ("file", local), ("pyav", "rtmp://host/live/key"),
                     ("srt", "srt://0.0.0.0:9000")]
    assert cfg.streams[0].name == "Room A" and cfg.streams[0].targets == ["fr", "pt"]
    assert cfg.streams[2].language == "no"  # quoted, so YAML kept it a string
    assert cfg.gateway.port == 0


def test_relative_source_resolves_against_yaml_folder_not_cwd(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, MINIMAL)
    monkeypatch.chdir("/")
    assert load_event(path).streams[0].resolved_source == str((tmp_path / "room-a.flac").resolve())


def test_default_archive_folder_resolves_against_yaml_folder_not_cwd(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, MINIMAL)  # no outputs section at all
    monkeypatch.chdir("/")
    assert load_event(path).outputs.archive.resolved_dir == (tmp_path / "archives").resolve()


def test_push_source_needs_no_file() -> None:
    cfg = parse_event("event: x\nstreams: [{id: a, source: push}]")
    assert (cfg.streams[0].source_kind, cfg.streams[0].resolved_source) == ("push", "push")


def test_unknown_top_level_key_is_rejected_at_its_line(tmp_path: Path) -> None:
    issue = only_issue(write(tmp_path, MINIMAL + "gatway:\n  port: 9000\n"))
    assert (issue.line, issue.key) == (5, "gatway")
    assert "unknown key 'gatway'" in issue.message
    assert "gateway" in issue.message  # the allowed keys are listed


def test_unknown_key_in_a_stream_is_rejected_at_its_line(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "  - id: room-b\n    source: push\n    langauge: fr\n")
    issue = only_issue(path)
    assert (issue.line, issue.key) == (7, "streams[1].langauge")
    assert "unknown key 'langauge'" in issue.message and "language" in issue.message


def test_bad_language_is_rejected(tmp_path: Path) -> None:
    issue = only_issue(write(tmp_path, MINIMAL + "    language: english\n"))
    assert (issue.line, issue.key) == (5, "streams[0].language")
    assert "2-letter ISO-639-1" in issue.message and "'english'" in issue.message


def test_unquoted_no_is_explained_as_a_yaml_boolean(tmp_path: Path) -> None:
    issue = only_issue(write(tmp_path, MINIMAL + "    targets: [fr, no]\n"))
    assert (issue.line, issue.key) == (5, "streams[0].targets")
    assert "YAML boolean" in issue.message


def test_targets_must_not_repeat_or_contain_own_language(tmp_path: Path) -> None:
    dup = only_issue(write(tmp_path, MINIMAL + "    targets: [fr, pt, fr]\n"))
    assert (dup.key, dup.message) == ("streams[0].targets", "duplicate target language(s): fr")
    own = only_issue(write(tmp_path, MINIMAL + "    language: en\n    targets: [en]\n"))
    assert (own.line, own.key) == (6, "streams[0].targets")
    assert "'en' is the stream's own language" in own.message


def test_duplicate_stream_id_points_at_the_second_id(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "  - id: room-b\n    source: push\n"
                                     "  - id: room-a\n    source: push\n")
    issue = only_issue(path)
    assert (issue.line, issue.key) == (7, "streams[2].id")
    assert issue.message == "duplicate stream id 'room-a' (first used by streams[0])"


def test_too_many_streams_for_the_pool_says_how_many_fit(tmp_path: Path) -> None:
    path = write(tmp_path, """\
event: Demo
engine:
  actors: 1
  streams_per_actor: 2
streams:
  - {id: a, source: push}
  - {id: b, source: push}
  - {id: c, source: push}
""")
    issue = only_issue(path)
    assert (issue.line, issue.key) == (5, "streams")
    assert "3 streams configured but the engine pool fits 2" in issue.message
    assert "raise engine.actors or engine.streams_per_actor" in issue.message


def test_tiny_en_rejects_french_and_auto(tmp_path: Path) -> None:
    path = write(tmp_path, """\
event: Demo
engine: {model: tiny.en}
streams:
  - {id: en, source: push, language: en}
  - id: fr
    source: push
    language: fr
  - {id: auto, source: push}
""")
    issues = issues_of(path)
    assert [(i.line, i.key) for i in issues] == [(7, "streams[1].language"),
                                                (8, "streams[2].language")]
    assert "English-only" in issues[0].message and "'fr'" in issues[0].message
    assert "'auto'" in issues[1].message


def test_missing_file_names_the_resolved_path(tmp_path: Path) -> None:
    issue = only_issue(write(tmp_path, MINIMAL.replace("room-a.flac", "audio/nope.wav")))
    assert (issue.line, issue.key) == (4, "streams[0].source")
    assert issue.message == f"file not found: {(tmp_path / 'audio' / 'nope.wav').resolve()}"


def test_unknown_url_scheme_lists_the_supported_ones(tmp_path: Path) -> None:
    issue = only_issue(write(tmp_path, MINIMAL.replace("room-a.flac", "gopher://host/a")))
    assert (issue.line, issue.key) == (4, "streams[0].source")
    assert "unknown scheme 'gopher://'" in issue.message
    for scheme in ("file://", "http://", "https://", "rtmp://", "rtsp://", "srt://", "push"):
        assert scheme in issue.message


def test_bad_redis_url_and_out_of_range_port(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "redis:\n  url: http://x\ngateway:\n  port: 70000\n")
    issues = issues_of(path)
    assert [(i.line, i.key) for i in issues] == [(6, "redis.url"), (8, "gateway.port")]
    assert "redis://" in issues[0].message
    assert "65535" in issues[1].message


def test_missing_key_points_at_nearest_parent(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "  - id: room-b\n    language: fr\n")
    issue = only_issue(path)
    assert (issue.line, issue.key, issue.message) == (5, "streams[1].source",
                                                      "required key is missing")


def test_yaml_syntax_error_gives_its_line(tmp_path: Path) -> None:
    path = write(tmp_path, "event: Demo\nstreams:\n  - id: a\n    source: push: x\n")
    issue = only_issue(path)
    assert issue.line == 4
    assert issue.key == "<yaml>"
    assert "mapping values are not allowed" in issue.message


def test_duplicate_yaml_key_is_reported(tmp_path: Path) -> None:
    issue = only_issue(write(tmp_path, "event: a\n" + MINIMAL))
    assert (issue.line, issue.key) == (2, "event")
    assert "duplicate key" in issue.message


def test_empty_file_and_non_mapping_top_level(tmp_path: Path) -> None:
    empty = only_issue(write(tmp_path, "# nothing yet\n"))
    assert empty.line is None and "empty" in empty.message
    as_list = only_issue(write(tmp_path, "- event: Demo\n"))
    assert (as_list.line, as_list.key) == (1, "<top level>")
    assert "expected a mapping" in as_list.message


def test_formatted_error_has_file_line_and_key(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "    language: english\n" + "bogus: 1\n")
    with pytest.raises(ConfigError) as info:
        load_event(path)
    lines = str(info.value).splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(f"{path}:5: streams[0].language: expected 'auto' or a 2-letter")
    assert lines[1].startswith(f"{path}:6: bogus: unknown key 'bogus'")
    assert str(ConfigIssue("examples/demo.yaml", 14, "streams[1].language", "bad")) == (
        "examples/demo.yaml:14: streams[1].language: bad")


def test_parse_event_uses_the_given_filename() -> None:
    with pytest.raises(ConfigError) as info:
        parse_event("event: x\nstreams: []\n", filename="inline.yaml")
    assert str(info.value).startswith("inline.yaml:2: streams: ")


def test_models_reject_unknown_keys_when_built_in_code() -> None:
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        StreamConfig.model_validate({"id": "a", "source": "push", "colour": "red"})


def test_every_field_has_a_description() -> None:
    models: list[type[BaseModel]] = [EventConfig, RedisConfig, RayConfig, EngineConfig,
                                     IngestConfig, StreamConfig, GatewayConfig]
    missing = [f"{m.__name__}.{name}" for m in models
               for name, field in m.model_fields.items() if not field.description]
    assert missing == []


def test_realtime_ws_engine_needs_a_websocket_url(tmp_path: Path) -> None:
    cfg = tmp_path / "rt.yaml"
    cfg.write_text("event: e\nengine:\n  kind: realtime-ws\n  model: voxtral\n"
                   "streams:\n  - {id: a, source: push}\n")
    with pytest.raises(ConfigError) as err:
        load_event(cfg)
    assert f"{cfg}:2: engine:" in str(err.value)
    assert "ws://" in str(err.value)


def test_realtime_ws_engine_maps_to_client_options(tmp_path: Path) -> None:
    from orchestrator.actor_options import engine_options
    from workers.engines.realtime_ws import RealtimeWsOptions

    cfg = tmp_path / "rt.yaml"
    cfg.write_text("event: e\nengine:\n  kind: realtime-ws\n  model: voxtral-mini\n"
                   "  url: ws://gpu-1:8000/v1/realtime\n  max_session_s: 2880\n"
                   "streams:\n  - {id: a, source: push, language: fr}\n")
    opts = engine_options(load_event(cfg))
    assert opts == RealtimeWsOptions(url="ws://gpu-1:8000/v1/realtime", model="voxtral-mini",
                                     delay_s=0.48, max_session_s=2880.0)


def test_embedded_engine_rejects_an_unknown_model(tmp_path: Path) -> None:
    cfg = tmp_path / "e.yaml"
    cfg.write_text("event: e\nengine: {model: whisper-large}\n"
                   "streams:\n  - {id: a, source: push}\n")
    with pytest.raises(ConfigError) as err:
        load_event(cfg)
    assert "whisper-large" in str(err.value)


def test_vllm_engine_yaml_maps_to_the_documented_engine_args() -> None:
    from orchestrator.actor_options import engine_options
    from workers.engines.vllm.engine import VllmEngineOptions, engine_kwargs

    cfg = load_event(Path(__file__).parent.parent / "examples" / "voxtral-gpu.yaml")
    opts = engine_options(cfg)
    assert isinstance(opts, VllmEngineOptions)
    assert opts.max_streams == 16 and opts.reanchor == "auto"
    fields = {"model", "tokenizer_mode", "config_format", "load_format", "dtype",
              "max_model_len", "max_num_seqs", "max_num_batched_tokens",
              "gpu_memory_utilization", "enforce_eager", "enable_prefix_caching",
              "limit_mm_per_prompt", "compilation_config"}
    kw = engine_kwargs(opts, fields)
    assert kw["model"] == "/models/Voxtral-Mini-4B-Realtime-2602"
    # 16 streams + 4 slots of headroom for warm rollovers.
    assert kw["max_num_seqs"] == 20 and kw["max_num_batched_tokens"] == 8000
    assert kw["tokenizer_mode"] == "mistral" and kw["load_format"] == "mistral"
    assert kw["max_model_len"] == 16384
    assert opts.sync_free_melspec is True  # measured: README
    assert opts.incremental_token_writes is True  # measured: README
    assert opts.window_trim is True


def test_vllm_delay_in_yaml_is_refused_with_where_it_comes_from(tmp_path: Path) -> None:
    cfg = tmp_path / "v.yaml"
    cfg.write_text("event: e\nengine:\n  kind: vllm\n  model: /m\n  vllm:\n"
                   "    delay_ms: 480\nstreams:\n  - {id: a, source: push}\n")
    with pytest.raises(ConfigError) as err:
        load_event(cfg)
    msg = str(err.value)
    assert "v.yaml:6" in msg and "delay_ms" in msg and "tekken.json" in msg


def test_vllm_section_without_vllm_engine_is_an_error(tmp_path: Path) -> None:
    cfg = tmp_path / "e.yaml"
    cfg.write_text("event: e\nengine:\n  vllm: {max_model_len: 4096}\n"
                   "streams:\n  - {id: a, source: push}\n")
    with pytest.raises(ConfigError) as err:
        load_event(cfg)
    assert "engine kind vllm" in str(err.value)


def test_default_streams_per_actor_follows_the_measured_knee_per_model_and_core() -> None:
    # bench.scale's knees on 2 cores: whisper-base 3 streams, tiny.en 6.
    assert default_streams_per_actor("whisper-base", cpu_threads=2, actors=1, cores=2) == 3
    assert default_streams_per_actor("tiny.en", cpu_threads=2, actors=1, cores=2) == 6
    # An actor uses its cpu_threads, never more cores than the host has for it.
    assert default_streams_per_actor("whisper-base", cpu_threads=8, actors=1, cores=8) == 12
    assert default_streams_per_actor("whisper-base", cpu_threads=8, actors=2, cores=8) == 6
    assert default_streams_per_actor("whisper-base", cpu_threads=2, actors=4, cores=2) == 1
    assert set(REALTIME_STREAMS_PER_CORE) == {"whisper-base", "tiny.en"}


def test_streams_per_actor_is_derived_only_when_the_file_does_not_set_it() -> None:
    cfg = parse_event("event: x\nengine: {model: tiny.en, cpu_threads: 1}\n"
                      "streams: [{id: a, source: push, language: en}]")
    assert cfg.engine.streams_per_actor == default_streams_per_actor("tiny.en", 1, 1)
    cfg = parse_event("event: x\nengine: {streams_per_actor: 7}\nstreams: [{id: a, source: push}]")
    assert cfg.engine.streams_per_actor == 7
    cfg = parse_event("event: x\nengine: {kind: realtime-ws, url: 'ws://h:1/v1/realtime'}\n"
                      "streams: [{id: a, source: push}]")
    assert cfg.engine.streams_per_actor == 4
    # vllm: the aged knee of bench.voxtral_capacity (orchestrator/capacity.py)
    cfg = parse_event("event: x\nengine: {kind: vllm, model: /m}\nstreams: [{id: a, source: push}]")
    assert cfg.engine.streams_per_actor == VLLM_STREAMS_PER_ACTOR == 18
    # fp8 KV on one or two engines per GPU, and on three: their own measured knees; more
    # engines per GPU have less KV cache than was measured, so they keep the bf16 figure
    def vllm(section: str) -> int:
        text = ("event: x\nengine: {kind: vllm, model: /m, vllm: {" + section + "}}\n"
                "streams: [{id: a, source: push}]")
        return parse_event(text).engine.streams_per_actor

    assert vllm("kv_cache_dtype: fp8") == VLLM_FP8_STREAMS_PER_ACTOR == 36
    assert vllm("kv_cache_dtype: fp8, engines_per_gpu: 2") == 36
    assert vllm("kv_cache_dtype: fp8, engines_per_gpu: 3") == VLLM_FP8_X3_STREAMS_PER_ACTOR == 18
    assert vllm("kv_cache_dtype: fp8, engines_per_gpu: 4") == 18
    # three under CUDA MPS (the operator says the nodes run it), chunks on the shared tick
    # (aligned_feed_ms, on by default): 25 per engine passed the strict rule, less 10 %;
    # feeding as they arrive, 20 kept up and 30 did not: 18; without MPS never more
    assert vllm("kv_cache_dtype: fp8, engines_per_gpu: 3, cuda_mps: true") \
        == VLLM_FP8_X3_MPS_ALIGNED_STREAMS_PER_ACTOR == 22
    assert vllm("kv_cache_dtype: fp8, engines_per_gpu: 3, cuda_mps: true, "
                "aligned_feed_ms: 0") == VLLM_FP8_X3_MPS_STREAMS_PER_ACTOR == 18
    assert vllm("kv_cache_dtype: fp8, engines_per_gpu: 3, cuda_mps: true, "
                "aligned_feed_ms: 40") == 22
    assert VllmConfig.model_fields["aligned_feed_ms"].default == ALIGNED_FEED_MS == 80
    assert vllm("kv_cache_dtype: fp8, engines_per_gpu: 3, cuda_mps: false") == 18
    assert vllm("kv_cache_dtype: auto, engines_per_gpu: 3, cuda_mps: true") == 18
    assert vllm("kv_cache_dtype: auto, engines_per_gpu: 2") == 18
    cfg = parse_event("event: x\nengine: {kind: vllm, model: /m, streams_per_actor: 5, "
                      "vllm: {kv_cache_dtype: fp8}}\nstreams: [{id: a, source: push}]")
    assert cfg.engine.streams_per_actor == 5


def test_engines_sharing_a_gpu_split_its_memory(tmp_path: Path) -> None:
    from orchestrator.actor_options import engine_options

    cfg = write(tmp_path, "event: e\nengine:\n  kind: vllm\n  model: /m\n  actors: 4\n"
                "  vllm:\n    gpu_memory_utilization: 0.9\n    engines_per_gpu: 2\n"
                "streams:\n  - {id: a, source: push}\n")
    opts = engine_options(load_event(cfg))
    assert opts.gpu_memory_utilization == 0.45  # type: ignore[union-attr]
    assert opts.cuda_mps is False  # type: ignore[union-attr]
    cfg = write(tmp_path, "event: e\nengine:\n  kind: vllm\n  model: /m\n"
                "  vllm:\n    engines_per_gpu: 3\n    cuda_mps: true\n"
                "streams:\n  - {id: a, source: push}\n")
    assert engine_options(load_event(cfg)).cuda_mps is True  # type: ignore[union-attr]
    # the chunks' shared tick reaches the engine: on by default, 0 when the event says so
    assert engine_options(load_event(cfg)).aligned_feed_ms == 80  # type: ignore[union-attr]
    cfg.write_text(cfg.read_text().replace("cuda_mps: true", "aligned_feed_ms: 0"))
    assert engine_options(load_event(cfg)).aligned_feed_ms == 0  # type: ignore[union-attr]
    cfg = write(tmp_path, "event: e\nengine:\n  kind: vllm\n  model: /m\n  vllm:\n"
                "    engines_per_gpu: 0\nstreams:\n  - {id: a, source: push}\n")
    with pytest.raises(ConfigError) as err:
        load_event(cfg)
    assert "engines_per_gpu" in str(err.value)


def test_a_fixed_kv_cache_reaches_the_engine_and_a_bad_one_names_its_line(
        tmp_path: Path) -> None:
    from orchestrator.actor_options import engine_options
    from workers.engines.vllm.options import engine_kwargs

    cfg = write(tmp_path, "event: e\nengine:\n  kind: vllm\n  model: /m\n  vllm:\n"
                "    engines_per_gpu: 3\n    kv_cache_gib: 30\n"
                "streams:\n  - {id: a, source: push}\n")
    opts = engine_options(load_event(cfg))
    assert opts.kv_cache_memory_bytes == 30 * 2**30  # type: ignore[union-attr]
    # what vLLM is given, where it knows the argument (0.26 does)
    assert engine_kwargs(opts, {"model", "kv_cache_memory_bytes"})[  # type: ignore[arg-type]
        "kv_cache_memory_bytes"] == 30 * 2**30
    cfg.write_text(cfg.read_text().replace("    kv_cache_gib: 30\n", ""))
    assert engine_options(load_event(cfg)).kv_cache_memory_bytes is None  # type: ignore[union-attr]
    cfg.write_text(cfg.read_text().replace("engines_per_gpu: 3\n",
                                           "engines_per_gpu: 3\n    kv_cache_gib: 0\n"))
    with pytest.raises(ConfigError) as err:
        load_event(cfg)
    (issue,) = err.value.errors
    assert issue.file == str(cfg) and issue.line == 7 and "kv_cache_gib" in issue.key


def test_the_tick_gather_reaches_the_engine_off_by_default_and_only_with_the_tick(
        tmp_path: Path) -> None:
    from orchestrator.actor_options import engine_options

    head = "event: e\nengine:\n  kind: vllm\n  model: /m\n  vllm:\n    engines_per_gpu: 3\n"
    tail = "streams:\n  - {id: a, source: push}\n"
    cfg = write(tmp_path, head + tail)
    assert engine_options(load_event(cfg)).tick_gather_ms == 0  # type: ignore[union-attr]
    budget = load_event(cfg).engine.streams_per_actor
    cfg.write_text(head + "    tick_gather_ms: 5\n" + tail)
    assert engine_options(load_event(cfg)).tick_gather_ms == 5  # type: ignore[union-attr]
    # It does not change the budget: no strict level has measured it yet.
    assert load_event(cfg).engine.streams_per_actor == budget
    # Without the tick it has nothing to gather; past half a tick it is refused.
    for bad, why in (("    aligned_feed_ms: 0\n    tick_gather_ms: 5\n", "aligned_feed_ms"),
                     ("    tick_gather_ms: 41\n", "40")):
        cfg.write_text(head + bad + tail)
        with pytest.raises(ConfigError) as err:
            load_event(cfg)
        (issue,) = err.value.errors
        assert issue.file == str(cfg) and "tick_gather_ms" in issue.key, issue
        assert issue.line == head.count("\n") + bad.count("\n"), issue
        assert why in issue.message, issue


def test_a_cluster_needs_a_redis_every_node_reaches(tmp_path: Path) -> None:
    from orchestrator.runtime import ray_namespace

    path = write(tmp_path, "event: e\nray: {address: auto}\nstreams:\n  - {id: a, source: push}\n")
    with pytest.raises(ConfigError) as err:
        load_event(path)
    assert f"{path}" in str(err.value) and "redis.url" in str(err.value)
    # events share a cluster: each has its own namespace for its actors' names
    assert ray_namespace("My Conference 2026!") == "babelcast-my-conference-2026"
    assert ray_namespace("Hall A") != ray_namespace("Hall B")


def test_the_shedding_policy_is_the_operators_choice() -> None:
    """engine.session.shed_after_s reaches the session manager's policy; unset, a stream
    keeps its backlog (issue 36)."""
    from orchestrator.actor_options import session_policy

    base = "event: e\nstreams:\n  - {id: a, source: push, language: en}\n"
    assert session_policy(parse_event(base)).shed_after_s is None
    shed = parse_event(base + "engine: {session: {shed_after_s: 20}}\n")
    assert session_policy(shed).shed_after_s == 20.0
    with pytest.raises(ConfigError, match="shed_after_s"):
        parse_event(base + "engine: {session: {shed_after_s: -1}}\n")


def test_more_pairs_than_the_translators_are_planned_for_is_said_at_validate(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One translator on the embedded engines is planned for
    `SENTENCE_PAIRS_PER_TRANSLATOR` stream-target pairs (the first whole-product run left
    one a minute behind): past it, validate says how many actors to set; pairs routed to
    an LLM backend are the server's to carry and do not count."""
    from orchestrator.capacity import SENTENCE_PAIRS_PER_TRANSLATOR, translation_over_capacity
    from orchestrator.cli import main

    def event(streams: int, extra: str = "") -> Path:
        rooms = "".join(f"  - {{id: r{i}, source: push, language: en, targets: [pt, fr]}}\n"
                        for i in range(streams))
        return write(tmp_path, f"event: e\nengine: {{streams_per_actor: {streams}}}\n"
                     f"{extra}streams:\n{rooms}")

    half = SENTENCE_PAIRS_PER_TRANSLATOR // 2
    assert translation_over_capacity(load_event(event(half))) is None  # 2 × half pairs: fits
    path = event(half + 1)
    warning = translation_over_capacity(load_event(path))
    assert warning is not None
    assert f"{2 * half + 2} stream-target pairs" in warning
    assert "translation.actors to 2 or more" in warning
    assert main(["validate", str(path)]) == 0  # a warning, never a refusal
    assert f"{path}: warning: {2 * half + 2} stream-target pairs" in capsys.readouterr().err
    assert translation_over_capacity(load_event(event(half + 1, "translation: {actors: 2}\n"))) \
        is None
    # en→fr on an LLM (the server's capacity): only the en→pt pairs count
    llm = event(half + 1, "translation: {routes: {en-fr: openai-chat}, openai: "
                          "{url: 'http://mt:8000/v1', model: m}}\n")
    assert translation_over_capacity(load_event(llm)) is None
