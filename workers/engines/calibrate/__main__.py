"""How many streams an embedded engine keeps in real time on the host it runs on.

`python -m workers.engines.calibrate [--model whisper-base|tiny.en] [--threads N]
[--refresh]` starts an engine with these options, prints its calibration (read from the
host's cache, or measured and cached: `workers.engines.calibrate`) as JSON, and closes it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from typing import Any

from workers.engines.calibrate import TARGET_BUSY, cache_path, calibration
from workers.engines.embedded import EmbeddedEngineOptions, EmbeddedWhisperEngine


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    engine = EmbeddedWhisperEngine(EmbeddedEngineOptions(model=args.model,
                                                         cpu_threads=args.threads))
    await engine.start()
    try:
        cal = await calibration(engine, refresh=args.refresh)
    finally:
        await engine.aclose()
    return {**dataclasses.asdict(cal), "key": json.loads(cal.key), "target_busy": TARGET_BUSY,
            "cache": str(cache_path())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="whisper-base", choices=["whisper-base", "tiny.en"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--refresh", action="store_true", help="measure even if cached")
    args = ap.parse_args()
    print(json.dumps(asyncio.run(_main(args)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
