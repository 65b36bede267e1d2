"""The ``triton`` backend: GPU kernels written in Triton (CUDA tensors; CPU tensors under
``TRITON_INTERPRET=1``, which is how CI proves them).

- ``cache_write``: RMSNorm + RoPE + paged scatter of the new tokens, and q's RoPE (one launch).
- ``decode``: absorbed (MQA) split-KV attention over the paged latent cache (stage 1).
- ``merge``: LSE merge of partial attentions, with the attention sink (decode stage 2,
  and the chunk merge of long prefill).
- ``prefill``: flash-attention forward of the up-projected (MHA) form, and the chunked driver.
- ``backend``: ``TritonBackend``, the class ``openmla.plan`` drives (see ``openmla.backends``).

Importing this package does not import triton; ``backend`` (and the kernel modules) do.
"""
