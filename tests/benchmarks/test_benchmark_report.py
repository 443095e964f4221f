"""benchmarks/report.py: the error analyses print their table, and with --out keep the
raw result beside it."""

from __future__ import annotations

import json

from tests.conftest import benchmark_module


def test_print_and_write_prints_the_table_and_writes_both_files(tmp_path, capsys):
    report = benchmark_module("report")
    result = {"right": {"2x2": [3, 4]}}
    report.print_and_write(result, "| a | b |\n", None)
    assert capsys.readouterr().out == "| a | b |\n" and not any(tmp_path.iterdir())
    out = tmp_path / "run" / "deeper"
    report.print_and_write(result, "| a | b |\n", out)
    assert json.loads((out / "results.json").read_text()) == result
    assert (out / "table.md").read_text() == "| a | b |\n"
    assert capsys.readouterr().out.endswith(f"wrote {out}\n")
