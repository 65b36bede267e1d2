"""Whole transformers DeepSeek models on openmla: ``attach`` a model, then ``generate`` or ``stream``.

```python
from openmla.hf import attach, generate
attach(model, num_pages=512)                    # every attention layer now runs on openmla's paged cache
outs = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=32)
```

Needs ``transformers`` (``pip install 'openmla[hf]'``).
"""

from .attach import Attachment, attach, attachment, detach, is_attached
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
