"""Sources in the event file: listen URLs a source cannot serve, secrets, HLS options.

Every problem is a `file:line: key: message` at validation time, never a surprise
when the event runs; `babelcast run` refuses to start without a stream's secret.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.actor_options import stream_options
from orchestrator.config import ConfigError, ConfigIssue, load_event
from orchestrator.source_config import read_stream_secrets

pytestmark = pytest.mark.unit

HEAD = "event: test\nengine: {streams_per_actor: 8}\nstreams:\n"


def write(tmp_path: Path, streams: str) -> Path:
    path = tmp_path / "event.yaml"
    path.write_text(HEAD + streams, encoding="utf-8")
    return path


def issues(tmp_path: Path, streams: str) -> list[ConfigIssue]:
    with pytest.raises(ConfigError) as info:
        load_event(write(tmp_path, streams))
    return info.value.errors


def one(tmp_path: Path, streams: str) -> ConfigIssue:
    found = issues(tmp_path, streams)
    assert len(found) == 1, found
    return found[0]


def test_push_listeners_with_their_secrets_in_env_names_load(tmp_path: Path) -> None:
    (tmp_path / "c.pem").write_text("x")
    (tmp_path / "k.pem").write_text("x")
    cfg = load_event(write(tmp_path, """\
  - {id: obs, source: "rtmp://0.0.0.0:1935/live", key_env: OBS_KEY}
  - {id: lan, source: "rtmp://127.0.0.1:1936/live?listen=1", key_env: LAN_KEY}
  - id: tls
    source: "rtmps://0.0.0.0:1937/live"
    key_env: TLS_KEY
    tls: {cert: c.pem, key: k.pem}
  - {id: srt, source: "srt://0.0.0.0:9000?mode=listener", key_env: SRT_PASS}
  - {id: hls, source: "https://cdn.example/live/index.m3u8", hls_start_segments: 2}
  - {id: pull, source: "rtmps://server.example/live/hall-a"}
"""))
    by_id = {s.id: s for s in cfg.streams}
    assert by_id["tls"].tls is not None and by_id["tls"].tls.cert == str(tmp_path / "c.pem")
    assert by_id["hls"].hls_start_segments == 2
    assert by_id["pull"].source_kind == "pyav"  # rtmps pull was refused before


def test_an_rtmp_listener_without_a_key_env_is_an_error(tmp_path: Path) -> None:
    issue = one(tmp_path, '  - {id: obs, source: "rtmp://0.0.0.0:1935/live"}\n')
    assert (issue.line, issue.key) == (4, "streams[0].key_env")
    assert "stream key" in issue.message and "environment variable" in issue.message


@pytest.mark.parametrize(("source", "says"), [
    ("http://0.0.0.0:8080/live.aac", "cannot listen"),
    ("rtsp://cam.local/stream?listen=1", "cannot listen"),
    ("rtmp://0.0.0.0:1935/live/my-secret-key", "key_env"),
    ("rtmp://encoder.local:1935/live?listen=1", "local address"),
    ("rtmps://0.0.0.0/live", "port"),
    ("srt://0.0.0.0?mode=listener", "port"),
    ("srt://0.0.0.0:9000?mode=listener&passphrase=hunter2hunter2", "secret"),
    ("srt://encoder:9000?mode=caller&passphrase=hunter2hunter2", "secret"),
])
def test_a_listen_url_no_source_can_serve_is_a_validation_error(
        tmp_path: Path, source: str, says: str) -> None:
    found = issues(tmp_path, f'  - {{id: a, source: "{source}", key_env: K}}\n')
    source_issues = [i for i in found if i.key == "streams[0].source"]
    assert source_issues, found
    assert source_issues[0].line == 4 and says in source_issues[0].message


def test_rtmps_listener_needs_tls_files_that_exist(tmp_path: Path) -> None:
    issue = one(tmp_path, '  - {id: a, source: "rtmps://0.0.0.0:1936/live", key_env: K}\n')
    assert issue.key == "streams[0].tls" and "cert" in issue.message
    found = issues(tmp_path, '  - {id: a, source: "rtmps://0.0.0.0:1936/live", key_env: K, '
                             'tls: {cert: nope.pem, key: nope.key}}\n')
    assert {i.key for i in found} == {"streams[0].tls.cert", "streams[0].tls.key"}
    assert all("file not found" in i.message for i in found)


@pytest.mark.parametrize(("extra", "key"), [
    ("key_env: K", "streams[0].key_env"),
    ("tls: {cert: a, key: b}", "streams[0].tls"),
    ("hls_start_segments: 2", "streams[0].hls_start_segments"),
])
def test_options_for_another_kind_of_source_are_errors(
        tmp_path: Path, extra: str, key: str) -> None:
    issue = one(tmp_path, f'  - {{id: a, source: "http://radio.example/live.aac", {extra}}}\n')
    assert issue.key == key


def test_a_key_env_must_be_a_variable_name(tmp_path: Path) -> None:
    issue = one(tmp_path, '  - {id: a, source: "rtmp://0.0.0.0:1935/live", '
                          'key_env: "the-key-itself!"}\n')
    assert issue.key == "streams[0].key_env" and "not an environment variable" in issue.message


def test_two_streams_cannot_listen_on_one_port(tmp_path: Path) -> None:
    issue = one(tmp_path, """\
  - {id: a, source: "rtmp://0.0.0.0:1935/live", key_env: A}
  - {id: b, source: "rtmp://127.0.0.1:1935/live?listen=1", key_env: B}
  - {id: c, source: "srt://0.0.0.0:1935?mode=listener"}
""")
    # TCP 1935 twice is an error; SRT's UDP 1935 is another port.
    assert (issue.line, issue.key) == (5, "streams[1].source")
    assert "'a'" in issue.message


def test_secrets_are_read_at_start_and_a_missing_one_is_named_not_shown(
        tmp_path: Path) -> None:
    cfg = load_event(write(tmp_path, """\
  - {id: obs, source: "rtmp://0.0.0.0:1935/live", key_env: OBS_KEY}
  - {id: srt, source: "srt://0.0.0.0:9000?mode=listener", key_env: SRT_PASS}
"""))
    secrets, problems = read_stream_secrets(cfg.streams, {"OBS_KEY": "obs-secret",
                                                          "SRT_PASS": "short"})
    assert secrets == {"obs": "obs-secret"}
    assert len(problems) == 1 and "SRT_PASS" in problems[0] and "10 to 79" in problems[0]
    assert "short" not in problems[0]
    _, problems = read_stream_secrets(cfg.streams, {})
    assert [p.split(":")[0] for p in problems] == ["streams[0] (obs)", "streams[1] (srt)"]


def test_the_key_reaches_the_ingest_options_but_never_their_repr(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_event(write(tmp_path, '  - {id: obs, source: "rtmp://0.0.0.0:1935/live", '
                                     'key_env: OBS_KEY}\n'))
    monkeypatch.setenv("OBS_KEY", "obs-secret-value")
    opts = stream_options(cfg.streams[0])
    assert opts.key == "obs-secret-value"
    assert "obs-secret-value" not in repr(opts)


def test_run_refuses_to_start_without_a_stream_key(tmp_path: Path) -> None:
    path = write(tmp_path, '  - {id: obs, source: "rtmp://0.0.0.0:1935/live", '
                           'key_env: BABELCAST_TEST_UNSET_KEY}\n')
    env = {k: v for k, v in __import__("os").environ.items()
           if k != "BABELCAST_TEST_UNSET_KEY"}
    result = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", str(path)],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2
    assert "BABELCAST_TEST_UNSET_KEY is not set" in result.stderr
    assert "nothing was started" in result.stderr


def test_the_encoders_example_validates_without_its_secrets() -> None:
    cfg = load_event(Path(__file__).parent.parent / "examples" / "encoders.yaml")
    assert [s.key_env for s in cfg.streams] == ["HALL_A_KEY", "HALL_B_PASSPHRASE", None]
