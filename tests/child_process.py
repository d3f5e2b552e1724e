"""Talking to a child process at the exact points a test needs, with a time limit on every wait, so
that a child that hangs fails the test at once instead of holding it until pytest's timeout."""

from __future__ import annotations

import select
import subprocess
import time
from typing import IO

import pytest

LIMIT_S = 300  # per wait: far above what a child does in these tests on a loaded 2-core machine


def read_until(stream: IO[str], text: str, limit_s: float = LIMIT_S) -> str:
    """The stream's lines up to the first one holding ``text``; fails the test if the child ends first or
    says nothing of it within ``limit_s``."""
    seen, deadline = "", time.monotonic() + limit_s
    while text not in seen:
        ready, _, _ = select.select([stream], [], [], max(0.0, deadline - time.monotonic()))
        line = stream.readline() if ready else ""
        if not line:
            pytest.fail(f"no {text!r} within {limit_s:g} s (the child ended or hung); it said:\n{seen[-3000:]}")
        seen += line
    return seen


def finish(process: subprocess.Popen, limit_s: float = LIMIT_S) -> tuple[int, str, str]:
    """(returncode, stdout, stderr) of ``process``; killed and failing the test after ``limit_s`` (a hang)."""
    try:
        out, err = process.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        pytest.fail(f"still running after {limit_s:g} s (a hang):\n{(err or '')[-3000:]}")
    return process.returncode, out, err


def tell(process: subprocess.Popen) -> None:
    """Lets a child that waits for a line on stdin go on."""
    assert process.stdin is not None
    process.stdin.write("\n")
    process.stdin.flush()
