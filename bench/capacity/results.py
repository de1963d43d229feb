"""Every device run's JSON kept with what made it (issue 34): the date, the commit, the exact
command, the host's fingerprint and the vLLM version travel inside the file, so a figure
in the README or docs can be traced to the run that made it (bench/capacity/render.py)."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
COMMIT_FILE = ROOT / ".stage" / "extra" / "COMMIT"
"""The device gets a copy of the working tree without .git: scripts/h200.sh's caller
writes the commit here (git-ignored, carried with .stage/extra)."""


def commit_of() -> str | None:
    """The commit the run's code came from: $BABELCAST_COMMIT, git, or COMMIT_FILE."""
    if os.environ.get("BABELCAST_COMMIT"):
        return os.environ["BABELCAST_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        return COMMIT_FILE.read_text().strip() or None
    except OSError:
        return None


def stamp(result: dict[str, Any], command: str) -> dict[str, Any]:
    """`result` with the run's provenance first."""
    return {"date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "commit": commit_of(), "command": command, **result}


def save(result: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def load(folder: str | Path, kind: str) -> list[tuple[Path, dict[str, Any]]]:
    """Every JSON file in `folder` whose `kind` is `kind`, in the order they were run (the
    file's `date`, then its name): a rerun of a level reads below the run before it."""
    out = []
    for path in sorted(Path(folder).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: not a JSON result ({exc})") from exc
        if isinstance(data, dict) and data.get("kind") == kind:
            out.append((path, data))
    out.sort(key=lambda item: (str(item[1].get("date", "")), item[0].name))
    return out
