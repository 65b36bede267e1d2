"""Run the Triton kernels through Triton's interpreter when no CUDA device is present.

The flag must be set before triton is first imported (transformers may import it), so it is
set here, when pytest loads this file, before any test module is collected.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))  # `from cases import ...` from any test module

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
