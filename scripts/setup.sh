#!/usr/bin/env bash
# Install everything Babelcast needs on a Debian 12 machine (as root, or with sudo):
# Debian packages (redis-server, ffmpeg, openssl, python3-venv, Apertium with its en-es and fr-es
# pairs for the embedded translator, Chromium for the overlay's browser tests, Asterisk's
# English/French/Spanish/Italian prompt recordings as test speech) and a virtualenv in .venv.
# Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v ffmpeg >/dev/null 2>&1 || missing+=(ffmpeg)
# openssl: the rtmps listener test makes a self-signed certificate with it.
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
command -v apertium >/dev/null 2>&1 || missing+=(apertium)
[ -f /usr/share/apertium/modes/eng-spa.mode ] || missing+=(apertium-eng-spa)
[ -f /usr/share/apertium/modes/fr-es.mode ] || missing+=(apertium-fr-es)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
# Held-out human speech with its text (English, and other languages for bench.languages):
# Asterisk's prompt recordings (CC-BY-SA-3.0; tests.speech.prompts_talk).
for lang in en fr es it; do
  [ -f "/usr/share/doc/asterisk-core-sounds-$lang/core-sounds-$lang.txt.gz" ] \
    || missing+=("asterisk-core-sounds-$lang" "asterisk-core-sounds-$lang-wav")
done
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v python3 >/dev/null 2>&1 || missing+=(python3)
if command -v python3 >/dev/null 2>&1; then
  python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || missing+=(python3-venv)
else
  missing+=(python3-venv)
fi
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi

python3 - <<'PY'
import sys
if sys.version_info < (3, 11):
    sys.exit(f"setup: Python >= 3.11 is required, found {sys.version.split()[0]}")
PY

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
echo "setup: installing Python packages (first run takes a few minutes)"
.venv/bin/python -m pip install -q -e ".[dev]"
# bench.peer's peer, WhisperLive 0.10.0, unmodified. Its declared requirements pull
# CUDA-only packages and PyAudio, so: torch's CPU build (pip takes torch==2.13.0 from
# this machine's wheel folder), then whisper-live without its dependencies; everything
# else its faster_whisper server imports is already a dependency of this project.
if ! .venv/bin/python -c 'import whisper_live, torch' >/dev/null 2>&1; then
  echo "setup: installing the benchmark peer (whisper-live 0.10.0 with CPU torch)"
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q --no-deps whisper-live==0.10.0
fi
