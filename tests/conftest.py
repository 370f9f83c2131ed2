"""Suite-wide options: ``--full`` runs the exhaustive sweeps (marked ``slow``), and every run ends
with the seconds each test file took, so the CI budget (docs/TESTING.md) stays visible.

    bash scripts/test.sh            # CI's run: everything but the ``slow`` sweeps
    bash scripts/test.sh --full     # the exhaustive sweeps too (a developer's run before a release)

A test marked ``slow`` repeats what a kept case already catches on more grids, schedules or shapes;
the kept cases are listed in docs/TESTING.md with the bug class each one guards.
"""
from __future__ import annotations

import collections
import gc
import os

import pytest

from usp_dit.testing import FULL_ENV
from usp_dit.testing.pool import POOL_ENV, close_pools

_FILE_SECONDS: collections.Counter[str] = collections.Counter()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true", default=False,
                     help="also run the exhaustive sweeps marked slow (USP_DIT_FULL=1 does the same)")


def _full(config: pytest.Config) -> bool:
    return bool(config.getoption("--full")) or os.environ.get(FULL_ENV) == "1"


def pytest_configure(config: pytest.Config) -> None:
    # Spawned ranks read it (usp_dit.testing.full_suite): they compute the slow cases only then.
    if _full(config):
        os.environ[FULL_ENV] = "1"
    # Distributed tests share warm ranks (Note [warm pool] in usp_dit.testing.pool): process
    # start-up was most of CI's time. USP_DIT_TEST_POOL=0 spawns fresh ranks for every job.
    os.environ.setdefault(POOL_ENV, "1")


def pytest_collection_finish(session: pytest.Session) -> None:
    # Every test module is imported (torch, Diffusers, transformers...): collections skip them from
    # now on (Note [frozen heap] in usp_dit.testing.pool; the in-process tests build many models).
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    close_pools()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _full(config):
        return
    skip = pytest.mark.skip(reason="exhaustive sweep: run with bash scripts/test.sh --full")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    # A failed test whose fixture values offer ``failure_context()`` (a server under test: its log,
    # its ranks' state) gets that text as a section of its report: CI shows it beside the traceback.
    report = yield
    if report.failed:
        seen: set[int] = set()
        for name, value in getattr(item, "funcargs", {}).items():
            context = getattr(value, "failure_context", None)
            if callable(context) and id(value) not in seen:
                seen.add(id(value))
                try:
                    report.sections.append((f"{name}: failure context", context()))
                except Exception as err:  # noqa: BLE001 -- the context is a help, never a second failure
                    report.sections.append((f"{name}: failure context", f"unavailable: {err!r}"))
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # setup + call + teardown: a module's spawned process group is set up (and torn down) in its
    # first (last) test's fixtures, and that is most of a distributed file's time.
    _FILE_SECONDS[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not _FILE_SECONDS:
        return
    total = sum(_FILE_SECONDS.values())
    terminalreporter.write_sep("-", f"seconds per test file ({total:.0f} s in all)")
    for path, seconds in _FILE_SECONDS.most_common():
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")
