"""The bench writer: the table goes to stdout, the result dict to JSON exactly as given."""

import json

import pytest

from ringllm.tools.bench.report import format_table, write_report


def test_write_report_prints_the_table_and_writes_the_result_unchanged(tmp_path, capsys):
    result = {"throughput_tok_s": 12.5, "p99_ttft_ms": 3.0, "nested": {"b": 1, "a": [1, 2]}}
    table = format_table("Demo Benchmark Result", [("Section", None), ("Rate (tok/s)", 12.5)])
    path = tmp_path / "result.json"
    write_report(result, table, str(path))
    out = capsys.readouterr().out
    assert out == table + "\n"
    assert "Rate (tok/s):" in out and "12.50" in out and "-Section-" in out
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n")
    assert json.loads(text) == result
    assert list(json.loads(text)) == list(result)  # key order kept, not sorted


def test_write_report_without_a_path_writes_no_file(tmp_path, capsys):
    write_report({"a": 1}, "table", None)
    assert capsys.readouterr().out == "table\n"
    assert list(tmp_path.iterdir()) == []


def test_write_report_names_a_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="result_json: folder .* does not exist"):
        write_report({"a": 1}, "table", str(tmp_path / "missing" / "result.json"))
