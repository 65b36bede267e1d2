"""Tensor parallelism on the CPU: ``tensor_parallel_size=2`` with vLLM's own multiprocess executor
(two worker processes, vLLM's CPU collectives), the plugin in each worker: each serves its shard of
the MLA heads (8 of the random-weight DeepSeek-V2's 16), and the greedy tokens equal the TP=1 run's
(up to near-ties: the o_proj all-reduce sums in another order).

vLLM's CPU workers bind their OpenMP threads one NUMA node per rank by default
(``VLLM_CPU_OMP_THREADS_BIND=auto``), and refuse two ranks on a one-node machine ("Not enough allowed
NUMA nodes to bind threads of 2 local CPUWorkers"), before any backend is asked; the test binds one
core per rank by hand (``0|1``), as a user of a one-node machine would. The workers are separate
processes, so generate.py's float64 comparison (a patch in its own process) does not reach them:
here the tokens are the check (openmla's calls at other head counts are checked against float64 in
one process by test_engine).
"""

from __future__ import annotations

from conftest import generate_cases
from test_engine import OURS, assert_tokens_equal, rounds


def test_two_tensor_parallel_workers_give_the_single_process_tokens(checkpoints, tmp_path):
    spec = dict(model=checkpoints["v2"], rounds=rounds(), max_tokens=8)
    tp2 = dict(spec, engine=dict(tensor_parallel_size=2, distributed_executor_backend="mp"))
    got, want = generate_cases([tp2, spec], tmp_path, openmla=True, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert got["impl"] is None and want["impl"] == OURS  # TP=2: no model in the engine's process
    for rank in (0, 1):  # each worker says that openmla serves its layers
        assert any(f"Worker_TP{rank} " in line for line in got["announce"]), got["announce"]
    assert got["chunked_prefill"] and got["prefix_caching"] and got["cached_tokens"][1][0] >= 256
    assert_tokens_equal(got, want)
