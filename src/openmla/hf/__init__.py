"""Whole transformers MLA models on openmla: ``attach`` a model, then ``generate`` or ``stream``.

The families it runs (DeepSeek-V2/V3/V3.2, Kimi K2/K2.5, GLM-4.7-Flash, GLM-5, MiniCPM3, Mistral 4,
Youtu, A.X K1/K2, Hunyuan V4 (and V4 VL, text only), dots3, ...) are listed in ``openmla.hf.families`` (``openmla models``);
``attach`` refuses every other model with a ``ValueError`` before changing it.

```python
from openmla.hf import attach, generate
attach(model, num_pages=512)                    # every attention layer now runs on openmla's paged cache
outs = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=32)
```

Needs ``transformers`` (``pip install 'openmla[hf]'``).
"""

from .attach import attach, detach
from .state import Attachment, attachment, is_attached
from .generate import TokenEvent, generate, stream
from .sampling import Sampling
from .scheduler import Limits
from .stats import GenerationStats, StepRecord
from .step import forward_step, step_context

__all__ = [
    "Attachment", "attach", "attachment", "detach", "is_attached",
    "TokenEvent", "generate", "stream", "Sampling", "Limits", "GenerationStats", "StepRecord",
    "forward_step", "step_context",
]
