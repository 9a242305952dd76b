"""The vLLM versions mooncake-lookout runs inside, and the start-up check that refuses any other.

Why: the connector subclasses vLLM's Mooncake store connector and reads private attributes of its scheduler
and worker (the scheduler's client and block sizes, the worker's key databases and lookup server). Those
change between vLLM releases without notice. So a vLLM the test suite never ran against fails when the
connector loads, in one line naming the supported versions, instead of failing later while serving.

:data:`SUPPORTED_VLLM_VERSIONS` is the one place the supported versions are written: the README's line
and the set-up's pins are checked against it by the tests.
"""

from __future__ import annotations

SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = ("0.33.0",)  # the versions the test suite runs against


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM is not one this release of mooncake-lookout was tested with."""


def supported_range() -> str:
    """The supported versions as a reader sees them, e.g. ``0.33.0``."""
    return " or ".join(SUPPORTED_VLLM_VERSIONS)


def installed_vllm_version() -> str:
    """The version of the vLLM this process imports (``vllm.__version__``)."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def is_supported(version: str) -> bool:
    """True for a supported release; a local build tag (``0.33.0+cpu``) does not change the release."""
    return version.split("+", 1)[0] in SUPPORTED_VLLM_VERSIONS


def require_supported_vllm(version: str | None = None) -> str:
    """Return the installed vLLM's version (or ``version``), or raise :class:`UnsupportedVllmVersion` in one line."""
    found = installed_vllm_version() if version is None else version
    if not is_supported(found):
        raise UnsupportedVllmVersion(
            f"mooncake-lookout supports vLLM {supported_range()} only, and this is vLLM {found}: install "
            f"vllm=={SUPPORTED_VLLM_VERSIONS[-1]}, or a mooncake-lookout release made for vLLM {found}")
    return found


__all__ = ["SUPPORTED_VLLM_VERSIONS", "UnsupportedVllmVersion", "installed_vllm_version", "is_supported",
           "require_supported_vllm", "supported_range"]
