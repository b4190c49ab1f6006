"""A pytest plugin for ``bench.gpu_check``'s tests parts: each test's result streamed as it ends, and a time limit
per test.

    python -m pytest -p bench.gpu_tests --stream=FILE --test-timeout=SECONDS ...

``--stream``: a JSON object per line, appended and flushed as it happens: first ``{"collected": [node ids]}``, then
per test ``{"test", "outcome", "seconds", "message"}`` (outcome passed, failed, error or skipped; a failure in
set-up or tear-down is an error, reported after the test's call). ``--test-timeout``: a test whose set-up, call and
tear-down take longer fails with :class:`TestTimeout`, raised by a signal: a test waiting inside a C call is
interrupted when the call returns (the check's own deadline ends a run where one never does).
"""
from __future__ import annotations

import json
import signal

import pytest


class TestTimeout(Exception):
    """A test ran past ``--test-timeout``."""


def pytest_addoption(parser):
    parser.addoption("--stream", help="append each test's result to this file, one JSON object per line")
    parser.addoption("--test-timeout", type=float, default=0.0, help="seconds per test (0: none)")


def pytest_configure(config):
    config.pluginmanager.register(Stream(config.getoption("stream"), config.getoption("test_timeout")))


def first_line(report) -> str:
    """A report's message: its first ``E`` line (the assertion or the exception), else its first line."""
    if report.longrepr is None:
        return ""
    text = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line.removeprefix("E").strip() for line in lines if line.startswith("E ")]
    return (errors or lines or [""])[0][:300]


class Stream:
    def __init__(self, path: str | None, limit: float):
        self.path, self.limit = path, limit

    def _write(self, record: dict) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def pytest_collection_finish(self, session):
        self._write({"collected": [item.nodeid for item in session.items]})

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        if not self.limit:
            yield
            return

        def expired(signum, frame):
            raise TestTimeout(f"the test ran past its {self.limit:g} s")

        previous = signal.signal(signal.SIGALRM, expired)
        signal.setitimer(signal.ITIMER_REAL, self.limit)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            outcome = report.outcome if report.when == "call" or report.skipped else "error"
            self._write({"test": report.nodeid, "outcome": outcome, "seconds": round(report.duration, 2),
                         "message": first_line(report)})
