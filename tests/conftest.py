"""Shared helpers for the tests: build a Run from CLI-style options, run the CLI in-process."""

from __future__ import annotations

import io
import json
import sys
from contextlib import redirect_stderr, redirect_stdout

import pytest

from memcalc.options import RunOptions, build_run


def run_of(**kw):
    return build_run(RunOptions(**kw))


def prediction_gap(rep: dict) -> dict[str, int]:
    """predicted - measured bytes of a `validate` report, whole step ("peak") and per phase."""
    out = {"peak": rep["predicted"]["peak_bytes"] - rep["measured"]["peak_bytes"]}
    for r in rep["rows"]:
        if r["section"] == "phases":
            out[r["name"]] = r["predicted"] - r["measured"]
    return out


def cli(*args: str) -> tuple[int, str, str]:
    """Run `memcalc ARGS` in-process; returns (exit code, stdout, stderr)."""
    from memcalc.cli import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with redirect_stdout(out), redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return code, out.getvalue(), err.getvalue()


def cli_json(*args: str) -> dict:
    code, out, err = cli(*args, "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.fixture
def memcalc_cli():
    return cli
