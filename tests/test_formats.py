"""--format table|json|markdown|csv, --check / --min-headroom exit codes, and `memcalc schema` (with the generated
docs/schema/estimate.schema.json kept equal to it)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from memcalc.cost.estimate import Estimate
from tests.conftest import cli, cli_json

ROOT = Path(__file__).resolve().parent.parent
FITS = ("estimate", "-m", "llama-3.1-8b", "--gpus", "8", "--zero", "3")
NO_FIT = ("estimate", "-m", "llama-3.1-70b", "--gpus", "8")


def test_format_json_equals_json_flag():
    a = cli_json(*FITS)
    code, out, err = cli(*FITS, "--format", "json")
    assert code == 0, err
    assert json.loads(out) == a


def test_format_csv_is_one_row_in_bytes_matching_the_json():
    d = cli_json(*FITS)
    code, out, err = cli(*FITS, "--format", "csv")
    assert code == 0, err
    rows = list(csv.DictReader(io.StringIO(out)))
    assert len(rows) == 1
    r = rows[0]
    assert int(r["peak_bytes"]) == d["memory"]["peak_bytes"]
    assert int(r["capacity_bytes"]) == d["memory"]["capacity_bytes"]
    assert int(r["params_bytes"]) == d["memory"]["components"]["params"]
    assert r["fits"] == "true" and r["zero"] == "3" and r["model"] == "llama-3.1-8b"


def test_format_markdown_is_a_table():
    code, out, err = cli(*FITS, "--format", "markdown", "--units", "GB")
    assert code == 0, err
    assert out.startswith("### Llama-3.1-8B")
    assert "| component | GB |" in out and "|---|---:|" in out and "**peak per GPU**" in out
    assert "**FITS**" in out


def test_sweep_csv_and_markdown():
    code, out, err = cli(*FITS, "--sweep", "micro-batch=1,2", "--format", "csv")
    assert code == 0, err
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [r["sweep_value"] for r in rows] == ["1", "2"] and rows[0]["sweep_key"] == "--micro-batch"
    code, out, err = cli(*FITS, "--sweep", "micro-batch=1,2", "--format", "markdown")
    assert code == 0 and out.count("\n") == 4 and out.startswith("| --micro-batch |")


@pytest.mark.parametrize("args,needle", [
    (("--format", "yaml"), "--format 'yaml' is not valid"),
    (("--format", "csv", "--json"), "disagree"),
    (("--min-headroom", "lots"), "--min-headroom 'lots' is not valid"),
    (("--min-headroom", "120%"), "percentage"),
])
def test_bad_output_options_are_one_line_exit_2(args, needle):
    code, out, err = cli(*FITS, *args)
    assert code == 2 and err.count("\n") == 1 and needle in err, err


def test_check_exit_codes():
    assert cli(*FITS, "--check")[0] == 0
    code, out, err = cli(*NO_FIT, "--check")
    assert code == 1 and "check failed: does not fit" in err
    assert cli(*NO_FIT)[0] == 0  # "does not fit" is a result without --check


def test_min_headroom_bytes_and_percent():
    d = cli_json(*FITS)
    room = d["memory"]["headroom_bytes"]
    cap = d["memory"]["capacity_bytes"]
    assert room > 2**30
    assert cli(*FITS, "--check", "--min-headroom", "1GiB")[0] == 0
    code, out, err = cli(*FITS, "--check", "--min-headroom", str(room + 1))
    assert code == 1 and "below --min-headroom" in err
    pct_ok = int(room / cap * 100) - 1
    assert cli(*FITS, "--min-headroom", f"{pct_ok}%")[0] == 0  # --min-headroom implies --check
    assert cli(*FITS, "--min-headroom", f"{pct_ok + 2}%")[0] == 1
    # a bare number below 1 is the same share (plan's form): 0.1 was read as 0.1 bytes before, a check that
    # always passed
    assert cli(*FITS, "--min-headroom", f"{pct_ok / 100}")[0] == 0
    assert cli(*FITS, "--min-headroom", f"{(pct_ok + 2) / 100}")[0] == 1
    # the JSON on stdout stays clean when the check fails
    code, out, err = cli(*FITS, "--json", "--min-headroom", "99%")
    assert code == 1 and json.loads(out)["memory"]["fits"] is True


def test_schema_command_and_generated_file_agree():
    code, out, err = cli("schema")
    assert code == 0, err
    schema = json.loads(out)
    assert schema == Estimate.model_json_schema()
    path = ROOT / "docs" / "schema" / "estimate.schema.json"
    assert path.read_text() == out, "regenerate: memcalc schema > docs/schema/estimate.schema.json"
    # every top-level key of a real estimate is described
    d = cli_json(*FITS)
    assert set(d) == set(schema["properties"])
    assert set(schema["required"]) <= set(d)


def test_import_report_is_an_optional_inputs_key(tmp_path):
    d = cli_json(*FITS)
    assert "import_report" not in d["inputs"]
    p = tmp_path / "ds.json"
    p.write_text('{"zero_optimization": {"stage": 3}, "bf16": {"enabled": true}}')
    d2 = cli_json("estimate", "-m", "llama-3.1-8b", "--gpus", "8", "--deepspeed-config", str(p))
    assert d2["inputs"]["import_report"]["applied"]["zero"] == 3
    Estimate.model_validate(d2)  # still an Estimate under the published schema
    assert set(d2) == set(d)


def test_plain_numbers_are_bytes_for_every_size_option():
    """A size without a unit is a number of bytes, as the error message for a bad size says: `--runtime-overhead 0`
    removes the runtime term, `--memory 85899345920` is 80 GiB written out (80 x 2^30)."""
    base = cli_json(*FITS)
    zero = cli_json(*FITS, "--runtime-overhead", "0")
    assert zero["memory"]["components"]["runtime"] == 0
    assert zero["memory"]["peak_bytes"] == base["memory"]["peak_bytes"] - base["memory"]["components"]["runtime"]
    assert cli_json(*FITS, "--memory", "85899345920")["memory"]["capacity_bytes"] == 80 * 2**30
    assert cli_json(*FITS, "--memory", "8.589934592e10")["memory"]["capacity_bytes"] == 80 * 2**30
    code, _, err = cli(*FITS, "--memory", "-5")
    assert code == 2 and err.count("\n") == 1 and "--memory '-5'" in err
