"""Compile report of the Triton kernels for GPUs this machine does not have.

    openmla compile-report [--targets sm_90,sm_100,gfx942] [--select ci] [--json PATH]
    python -m openmla_tools.compile_report ...      (the same, without the tools extra's rich)

Every kernel launch the backend makes (``launches``) is specialised the way Triton's runtime
specialises a real launch (``specialize``: divisibility hints, constant 1s, AMD buffer ranges),
compiled for Hopper (sm_90), Blackwell (sm_100) and MI300X (gfx942) with the toolchains in the
triton wheel, and measured (``resources``): registers, spills, shared memory (LDS), and the
occupancy they allow (``targets``). ``check`` names the rows that spill, overflow shared
memory or fail to compile; ``roofline`` gives the benchmark shapes' bytes, FLOPs and the times
they imply at each device's published bandwidth and matmul rate; ``command`` is the front end
(arguments, printing). No GPU is needed.
TRITON_INTERPRET must be unset (the report compiles real kernels).
"""
