"""How the error-analysis benchmarks hand back what they measured: the markdown table on
stdout, and with --out the raw result and the table side by side."""

from __future__ import annotations

import json
import pathlib


def print_and_write(result: dict, table: str, out: pathlib.Path | None) -> None:
    """Print `table`; with `out`, write results.json (`result`) and table.md there."""
    print(table, end="")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "table.md").write_text(table)
        print(f"wrote {out}")
