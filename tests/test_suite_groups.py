"""The scheduling groups scripts/test.sh runs (tests/conftest.py): every module named in
them exists, so a rename cannot silently move a test with a wall-clock bound into the
group that runs beside other work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ALONE_MODULES, QUIET_MODULES

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parent


def test_every_grouped_module_exists_and_is_in_one_group() -> None:
    for name in QUIET_MODULES | ALONE_MODULES:
        assert (TESTS / f"{name}.py").is_file(), name
    assert not QUIET_MODULES & ALONE_MODULES


def collected(*args: str) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", *args],
                         cwd=TESTS.parent, capture_output=True, text=True, timeout=120)
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_the_groups_select_what_scripts_test_sh_asks_for() -> None:
    files = ("tests/test_failover.py", "tests/test_overload.py", "tests/test_suite_groups.py")
    quiet = collected("-m", "quiet", *files)
    alone = collected("-m", "alone", *files)
    rest = collected("-m", "not quiet and not alone", *files)
    assert quiet and all(n.startswith("tests/test_failover.py::") for n in quiet)
    assert alone and all(n.startswith("tests/test_overload.py::") for n in alone)
    assert rest and all(n.startswith("tests/test_suite_groups.py::") for n in rest)
