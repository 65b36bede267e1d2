"""MAX's one-chunk prefill with given keys is a protocol beside the MLA kernels
(``openmla.backends.ChunkPrefillKernels``), not a ``Backend`` method: the registered backends
have it, a backend without it makes ``flare_mla_prefill`` raise ``NotImplementedError``."""

from __future__ import annotations

import pytest

import openmla
from openmla import backends
from openmla.backends import CHUNK_PREFILL, Backend, ChunkPrefillKernels

from cases import make_case, small_config
from malformed import flare_args


def test_backend_holds_the_mla_kernels_only():
    assert not hasattr(Backend, "flare_mla_prefill")
    for name in sorted(CHUNK_PREFILL):
        try:
            be = backends.load_backend(name)
        except ValueError:  # triton not installed, native kernels not built
            continue
        assert isinstance(be, ChunkPrefillKernels), name


def test_a_backend_without_the_protocol_refuses_the_chunk(monkeypatch):
    monkeypatch.setitem(backends.REGISTRY, "einsum", "einsum_backend:EinsumBackend")  # tests/einsum_backend.py, not registered for it
    case = make_case([5, 0, 3], [2, 1, 4], config=small_config(num_heads=2), page_size=4)
    with pytest.raises(NotImplementedError, match="einsum backend does not implement the flare_mla_prefill kernel"):
        openmla.flare_mla_prefill(**flare_args(case), backend="einsum")
    out = openmla.flare_mla_prefill(**flare_args(case), backend="torch")  # a registered one runs it
    assert out.shape[:2] == case.q.shape[:2]
