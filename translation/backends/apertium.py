"""Debian Apertium as a translation backend: rule-based, CPU, run as a process.

Installed pairs (Debian `apertium-eng-spa`, `apertium-fr-es`) give en↔es and fr↔es
directly; en↔fr go through Spanish (two runs). A batch of one pair is one process
run with one sentence per line (~0.2 s to start, then hundreds of sentences a
second), so batching across streams is what makes it cheap.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path

from translation.backends.base import (
    BackendError,
    BackendInterrupted,
    BackendTimeout,
    SentenceEngine,
)
from workers.aio import wait_for

MODES_DIR = Path("/usr/share/apertium/modes")

# (source, target) → Apertium modes to run in order.
ROUTES: dict[tuple[str, str], tuple[str, ...]] = {
    ("en", "es"): ("eng-spa",),
    ("es", "en"): ("spa-eng",),
    ("fr", "es"): ("fr-es",),
    ("es", "fr"): ("es-fr",),
    ("en", "fr"): ("eng-spa", "es-fr"),
    ("fr", "en"): ("fr-es", "spa-eng"),
}


def supports(source: str, target: str) -> bool:
    return (source, target) in ROUTES


class ApertiumTranslator(SentenceEngine):
    name = "apertium"

    def __init__(self, timeout_s: float = 20.0, modes_dir: Path = MODES_DIR) -> None:
        super().__init__()
        self.timeout_s = timeout_s
        self.modes_dir = modes_dir

    async def start(self) -> None:
        if shutil.which("apertium") is None:
            raise BackendError("the apertium command is not installed (Debian package "
                               "'apertium'; scripts/setup.sh installs it)")
        missing = sorted({m for modes in ROUTES.values() for m in modes
                          if not (self.modes_dir / f"{m}.mode").is_file()})
        if missing:
            raise BackendError(f"Apertium modes missing under {self.modes_dir}: "
                               f"{', '.join(missing)} (Debian packages apertium-eng-spa, "
                               "apertium-fr-es)")

    async def _translate_pair(self, texts: list[str], source: str,
                              target: str) -> list[str]:
        modes = ROUTES.get((source, target))
        if modes is None:
            raise BackendError(f"apertium has no {source}→{target}")
        # One sentence per line: a newline inside a sentence would shift every line.
        lines = [" ".join(t.split()) for t in texts]
        for mode in modes:
            lines = await self._run(mode, lines)
        return lines

    async def _run(self, mode: str, lines: list[str]) -> list[str]:
        # The input goes through a file, not stdin: the apertium script opens /dev/stdin,
        # which fails when stdin is a socket (as event loops such as Ray's give a child).
        with tempfile.NamedTemporaryFile("wb", prefix="babelcast-mt-", suffix=".txt") as f:
            f.write(("\n".join(lines) + "\n").encode())
            f.flush()
            proc = await asyncio.create_subprocess_exec(
                "apertium", "-u", mode, f.name,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env={**os.environ, "LC_ALL": "C.UTF-8"},
            )
            try:
                out, err = await wait_for(proc.communicate(), self.timeout_s)
            except TimeoutError:
                proc.kill()
                await proc.wait()
                raise BackendTimeout(
                    f"apertium {mode} timed out after {self.timeout_s} s") from None
        if proc.returncode is not None and proc.returncode < 0:
            raise BackendInterrupted(f"apertium {mode} was killed by signal "
                                     f"{-proc.returncode}")
        if proc.returncode != 0:
            raise BackendError(f"apertium {mode} exited {proc.returncode}: "
                               f"{err.decode(errors='replace').strip()[:200]}")
        result = out.decode(errors="replace").split("\n")
        if result and result[-1] == "":
            result.pop()
        if len(result) != len(lines):
            raise BackendError(f"apertium {mode} returned {len(result)} lines for "
                               f"{len(lines)} sentences")
        return [r.strip() for r in result]
