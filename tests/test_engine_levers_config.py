"""The embedded engine's accuracy levers (issue 37) and its host calibration, from the
event file: keys, errors that name them, and the calibrated default streams per actor."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from orchestrator.actor_options import engine_options
from orchestrator.capacity import default_streams_per_actor
from orchestrator.config import ConfigError, ConfigIssue, EngineConfig, load_event
from orchestrator.config.engine import EMBEDDED_ONLY
from workers.engines import calibrate
from workers.engines.base import SessionOptions
from workers.engines.calibrate import Calibration
from workers.engines.embedded import EmbeddedEngineOptions
from workers.engines.embedded_options import PART_EDGE_DEFAULT_S, part_edge_for
from workers.engines.embedded_session import EmbeddedWhisperSession

pytestmark = pytest.mark.unit

LEVERS = """\
event: e
engine:
  final_beam_size: 5
  final_prompt_words: 20
  final_context_s: 5.0
  unfinished_pause_s: 1.2
  final_beam_max_busy: 0.5
  final_early_s: 0.3
  part_edge_s: 0.75
  part_on_time: false
  calibrate: true
streams:
  - {id: a, source: push}
"""

CONSTANT = default_streams_per_actor("whisper-base", 2, 1)
"""The per-core default on this host (whisper-base, 2 threads, 1 actor): at most 3."""
CALIBRATED = 7
"""A cached figure the per-core constant can never be for 2 threads (1.5 per core)."""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "event.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def only_issue(path: Path) -> ConfigIssue:
    with pytest.raises(ConfigError) as info:
        load_event(path)
    assert len(info.value.errors) == 1, info.value.errors
    return info.value.errors[0]


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty calibration cache of this test's own (never the user's)."""
    home = tmp_path / "cache"
    monkeypatch.delenv(calibrate.CACHE_ENV, raising=False)  # the suite's own file
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    assert calibrate.cache_path() == home / "babelcast" / "calibration.json"
    return home


def cache(options: EmbeddedEngineOptions, streams: int) -> None:
    calibrate.store(Calibration(busy_per_stream=round(0.7 / streams, 4), streams=streams,
                                key=calibrate.host_key(options), measured_at=time.time()))


def test_levers_load_from_the_event_file_and_reach_the_engine(
        tmp_path: Path, cache_home: Path) -> None:
    cfg = load_event(write(tmp_path, LEVERS))
    e = cfg.engine
    assert (e.final_prompt_words, e.final_context_s, e.unfinished_pause_s,
            e.final_beam_max_busy, e.final_early_s, e.part_edge_s, e.part_on_time,
            e.calibrate) == (20, 5.0, 1.2, 0.5, 0.3, 0.75, False, True)
    assert engine_options(cfg) == EmbeddedEngineOptions(
        final_beam_size=5, final_prompt_words=20, final_context_s=5.0,
        unfinished_pause_s=1.2, final_beam_max_busy=0.5, final_early_s=0.3,
        part_edge_s=0.75, part_on_time=False, calibrate=True)


def test_left_out_the_levers_are_the_engines_own_defaults(tmp_path: Path) -> None:
    # One exception: an event plans on this host's measured figure (calibrate on), an
    # engine made in code measures only when asked.
    for key in EMBEDDED_ONLY:
        field = EngineConfig.model_fields[key]
        engine_default = getattr(EmbeddedEngineOptions(), key)
        assert field.default == (True if key == "calibrate" else engine_default), key
        assert field.description and "embedded only" in field.description, key
    cfg = load_event(write(tmp_path, "event: e\nstreams:\n  - {id: a, source: push}\n"))
    assert engine_options(cfg) == EmbeddedEngineOptions(calibrate=True)


def test_part_edge_left_unset_is_per_language_and_auto_takes_the_detected_one() -> None:
    assert part_edge_for(None, "en") == 0.75
    assert part_edge_for(None, "fr") == part_edge_for(None, "it") == PART_EDGE_DEFAULT_S == 1.0
    assert part_edge_for(None, None) == 1.0, "auto before it has detected a language"
    assert part_edge_for(0.5, "en") == part_edge_for(0.5, "fr") == 0.5, "the event's wins"

    class OptionsOnlyHost:
        """A session reads only its host's options when it is made (no model here)."""
        options = EmbeddedEngineOptions()

    auto = EmbeddedWhisperSession(OptionsOnlyHost(), SessionOptions("a", "auto"))  # type: ignore[arg-type]
    assert auto._part_edge_s == 1.0
    auto._detected = "en"
    assert auto._part_edge_s == 0.75
    french = EmbeddedWhisperSession(OptionsOnlyHost(), SessionOptions("f", "fr"))  # type: ignore[arg-type]
    assert french._part_edge_s == 1.0


@pytest.mark.parametrize(("key", "value", "says"), [
    ("final_prompt_words", "-1", "greater than or equal to 0"),
    ("final_prompt_words", "300", "less than or equal to 224"),
    ("final_context_s", "40", "less than or equal to 28"),
    ("unfinished_pause_s", "0", "greater than 0"),
    ("unfinished_pause_s", "0.5", "longer than pause_s (0.6)"),
    ("final_beam_max_busy", "1.5", "less than or equal to 1"),
    ("final_early_s", "-0.1", "greater than or equal to 0"),
    ("final_early_s", "0.6", "shorter than pause_s (0.6)"),
    ("calibrate", "sometimes", "valid boolean"),
    ("part_edge_s", "0", "greater than 0"),
    ("part_on_time", "maybe", "valid boolean"),
])
def test_a_bad_lever_value_is_an_error_at_its_key_and_line(
        tmp_path: Path, key: str, value: str, says: str) -> None:
    path = write(tmp_path, f"event: e\nengine:\n  cpu_threads: 2\n  {key}: {value}\n"
                           "streams:\n  - {id: a, source: push}\n")
    issue = only_issue(path)
    assert (issue.file, issue.line, issue.key) == (str(path), 4, f"engine.{key}")
    assert says in issue.message
    assert f"{path}:4: engine.{key}: " in str(issue)


@pytest.mark.parametrize("key", EMBEDDED_ONLY)
def test_a_lever_under_the_vllm_engine_is_an_error_naming_it(tmp_path: Path, key: str) -> None:
    # Even at the embedded default: a key the engine in use never reads is a mistake.
    default = EngineConfig.model_fields[key].default
    shown = "null" if default is None else str(default).lower()
    path = write(tmp_path, f"event: e\nengine:\n  kind: vllm\n  model: /m\n  {key}: {shown}\n"
                           "streams:\n  - {id: a, source: push}\n")
    issue = only_issue(path)
    assert (issue.line, issue.key) == (5, f"engine.{key}")
    assert "only for engine kind embedded" in issue.message and "vllm" in issue.message


def test_a_lever_under_realtime_ws_is_an_error_too(tmp_path: Path) -> None:
    path = write(tmp_path, "event: e\nengine:\n  kind: realtime-ws\n"
                           "  url: ws://gpu-1:8000/v1/realtime\n  calibrate: true\n"
                           "streams:\n  - {id: a, source: push}\n")
    issue = only_issue(path)
    assert (issue.line, issue.key) == (5, "engine.calibrate")
    assert "realtime-ws" in issue.message


def test_calibrated_default_is_this_hosts_cached_figure_for_these_options(
        tmp_path: Path, cache_home: Path) -> None:
    path = write(tmp_path, LEVERS)
    # Nothing measured here yet: the per-core constant.
    cfg = load_event(path)
    assert cfg.engine.streams_per_actor == CONSTANT
    assert not calibrate.cache_path().exists()
    # What the actor's engine caches under its own options (the engine_options the event
    # hands it) is what the next load of the file takes.
    cache(engine_options(cfg), CALIBRATED)
    assert calibrate.cache_path().is_relative_to(cache_home)
    assert load_event(path).engine.streams_per_actor == CALIBRATED


def test_a_figure_for_other_options_or_without_calibrate_is_not_taken(
        tmp_path: Path, cache_home: Path) -> None:
    cfg = load_event(write(tmp_path, LEVERS))
    # Measured with a shorter prompt: another decode cost, another key.
    cache(dataclasses.replace(engine_options(cfg), final_prompt_words=10), CALIBRATED)
    assert load_event(write(tmp_path, LEVERS)).engine.streams_per_actor == CONSTANT
    # Measured for exactly these options, but calibrate is off: behaviour unchanged.
    cache(engine_options(cfg), CALIBRATED)
    off = LEVERS.replace("calibrate: true", "calibrate: false")
    assert load_event(write(tmp_path, off)).engine.streams_per_actor == CONSTANT
    assert load_event(write(tmp_path, LEVERS)).engine.streams_per_actor == CALIBRATED


@pytest.mark.parametrize("explicit", [1, 2, 12])
def test_an_explicit_streams_per_actor_always_wins(
        tmp_path: Path, cache_home: Path, explicit: int) -> None:
    cfg = load_event(write(tmp_path, LEVERS))
    cache(engine_options(cfg), CALIBRATED)
    text = LEVERS.replace("  calibrate: true\n",
                          f"  calibrate: true\n  streams_per_actor: {explicit}\n")
    assert load_event(write(tmp_path, text)).engine.streams_per_actor == explicit


def test_a_cache_written_elsewhere_is_not_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # XDG_CACHE_HOME decides where the figure is: one stored under another home is unseen.
    monkeypatch.delenv(calibrate.CACHE_ENV, raising=False)  # the suite's own file
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "one"))
    cfg = load_event(write(tmp_path, LEVERS))
    cache(engine_options(cfg), CALIBRATED)
    assert load_event(write(tmp_path, LEVERS)).engine.streams_per_actor == CALIBRATED
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "two"))
    assert load_event(write(tmp_path, LEVERS)).engine.streams_per_actor == CONSTANT


def test_a_malformed_cpu_threads_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    # The embedded default is computed from validated fields (it once compared the raw
    # string with an int and raised TypeError out of the loader).
    issue = only_issue(write(tmp_path, "event: e\nengine:\n  cpu_threads: abc\n"
                                       "streams:\n  - {id: a, source: push}\n"))
    assert (issue.line, issue.key) == (3, "engine.cpu_threads")


def test_a_hot_apply_keeps_the_running_budget_when_only_the_calibrated_default_moved(
        tmp_path: Path, cache_home: Path) -> None:
    from orchestrator.apply import keep_running_budget, plan

    old = load_event(write(tmp_path, LEVERS))  # the first start: nothing measured yet
    cache(engine_options(old), CALIBRATED)  # its actors measured the host
    new = load_event(write(tmp_path, LEVERS.replace("{id: a, source: push}",
                                                    "{id: a, source: push, name: Hall}")))
    assert new.engine.streams_per_actor == CALIBRATED
    assert plan(old, new).refused  # as an engine change: every apply refused until restart
    kept = keep_running_budget(old, new)
    assert kept.engine.streams_per_actor == CONSTANT
    p = plan(old, kept)
    assert (p.refused, p.changed) == ([], {"a": ["name"]})
    # Once kept, the next apply on top of it keeps it again.
    assert keep_running_budget(kept, new).engine.streams_per_actor == CONSTANT
    # A budget the file sets is the operator's: a change to it is refused as before.
    explicit = load_event(write(tmp_path, LEVERS.replace(
        "  calibrate: true\n", f"  calibrate: true\n  streams_per_actor: {CALIBRATED}\n")))
    assert keep_running_budget(old, explicit) is explicit
    assert plan(old, explicit).refused


def test_calibration_is_the_default_and_a_low_figure_never_refuses_the_file(
        tmp_path: Path, cache_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 37: the default streams per actor is what this host measured. A host that
    carries fewer streams than the event has (here a cached 1, against 3 streams) still
    loads the file: the budget fits the streams, and validate and status say it is over.
    Before, the same file loaded on one host and was an error on another."""
    from orchestrator.capacity import over_capacity
    from orchestrator.cli import main

    three = ("event: e\nstreams:\n  - {id: a, source: push}\n  - {id: b, source: push}\n"
             "  - {id: c, source: push}\n")
    path = write(tmp_path, three)
    cfg = load_event(path)
    assert cfg.engine.calibrate is True
    cache(engine_options(cfg), 1)
    cfg = load_event(path)
    assert cfg.engine.streams_per_actor == 3 and cfg.engine._host_carries == 1
    warning = over_capacity(cfg)
    assert warning is not None and "1 per actor, measured on this host" in warning
    assert main(["validate", str(path)]) == 0
    assert "warning: 3 streams on 1 ASR actor(s)" in capsys.readouterr().err
    # Three actors (on three hosts: ray.address) carry one each: a fit, no warning.
    spread = load_event(write(tmp_path, three.replace("event: e\n",
                                                      "event: e\nengine: {actors: 3}\n")))
    assert spread.engine.streams_per_actor == 1 and over_capacity(spread) is None
    # An operator's figure is a hard budget, as before.
    issue = only_issue(write(tmp_path, three.replace(
        "event: e\n", "event: e\nengine: {streams_per_actor: 1}\n")))
    assert "3 streams configured but the engine pool fits 1" in issue.message


@pytest.mark.integration
def test_run_measures_this_host_before_it_plans_once(
        tmp_path: Path, cache_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`babelcast run`'s first step (cli._measured) on a host with nothing cached: it
    measures with the actors' own engine options, caches the figure, and plans on it; a
    second run reads it. Events that do not plan on it are not measured."""
    from orchestrator.capacity import needs_measuring
    from orchestrator.cli import _measured

    text = ("event: e\nengine: {model: tiny.en, cpu_threads: 1}\n"
            "streams:\n  - {id: a, source: push, language: en}\n")
    path = write(tmp_path, text)
    cfg = load_event(path)
    assert needs_measuring(cfg) == engine_options(cfg)
    planned = _measured(str(path), cfg)
    err = capsys.readouterr().err
    assert "measuring how many tiny.en streams this host keeps in real time" in err
    hit = calibrate.cached(engine_options(cfg))
    assert hit is not None and f"keeps {hit.streams} stream(s) per ASR actor" in err
    assert planned.engine.streams_per_actor == hit.streams
    assert needs_measuring(planned) is None
    assert _measured(str(path), planned) is planned and capsys.readouterr().err == ""
    for other in ("engine: {model: tiny.en, cpu_threads: 1, streams_per_actor: 2}",
                  "engine: {model: tiny.en, cpu_threads: 1, calibrate: false}",
                  "engine: {model: tiny.en, cpu_threads: 2}\nray: {address: 'ray://h:1'}\n"
                  "redis: {url: 'redis://h:6379'}"):
        other_cfg = load_event(write(tmp_path, text.replace(
            "engine: {model: tiny.en, cpu_threads: 1}", other)))
        assert needs_measuring(other_cfg) is None, other
