"""Static roofline of the GPU benchmark shapes (``bench/gpu_bench.py``): the bytes and FLOPs one
call needs and the time they imply at each device's published HBM bandwidth and dense bf16
matmul rate, ``max(bytes / bandwidth, FLOPs / rate)``.

Bytes are what must cross HBM once (inputs read, outputs written; the paged cache read once per
call, not once per head block); split-KV partials and re-reads are the kernels' own cost and are
left out. FLOPs count the math needed: causal pairs only, two per multiply-add.
"""

from __future__ import annotations

from dataclasses import dataclass

from openmla.fp8 import ds_mla_record_bytes

L, R, DN, DV = 512, 64, 128, 128
BF16 = 2


@dataclass(frozen=True)
class Device:
    name: str
    hbm_GBps: float
    bf16_TFLOPs: float


DEVICES = (
    Device("H100 SXM", 3350, 989.4),  # NVIDIA H100 Tensor Core GPU datasheet: 3.35 TB/s HBM3, BF16 989.4 TFLOPS dense
    Device("H200 SXM", 4800, 989.4),  # NVIDIA H200 Tensor Core GPU datasheet: 4.8 TB/s HBM3e, BF16 989 TFLOPS dense
    Device("B200", 8000, 2250.0),  # NVIDIA HGX B200 datasheet: 8 TB/s HBM3e, BF16 4.5 PFLOPS with sparsity = 2.25 dense
    Device("MI300X", 5300, 1307.4),  # AMD Instinct MI300X datasheet: 5.3 TB/s HBM3, BF16 1307.4 TFLOPS dense
)

# The benchmark shapes of bench/gpu_bench.py (DeepSeek dims, page 64, bf16 queries).
DECODE = [(b, h, c) for c in (4096, 32768) for b in (64, 128) for h in (16, 128)]  # (B, H, context)
FP8_DECODE = [(64, 16, 4096), (64, 128, 4096)]
PREFILL = [(1, 8192), (8, 1024)]  # (B, new tokens each), empty cache
PREFILL_H = 128
WRITE_T = 8192


def cache_bytes_per_token(cache_format: str) -> int:
    return {"native": BF16 * (L + R), "fp8_e4m3": L + R, "fp8_ds_mla": ds_mla_record_bytes(L, R)}[cache_format]


def decode_call(B: int, H: int, ctx: int, cache_format: str = "native") -> dict:
    """One new token per sequence seeing ``ctx`` keys: the cache read once, q in, latent out."""
    nbytes = B * ctx * cache_bytes_per_token(cache_format) + B * H * (L + R) * BF16 + B * H * L * BF16
    return {"op": "decode", "shape": f"{cache_format} B={B} H={H} ctx={ctx}", "bytes": nbytes,
            "flops": 2 * B * H * ctx * (L + R + L)}


def prefill_kernel_call(B: int, n: int, H: int = PREFILL_H) -> dict:
    """The flash kernel on up-projected K/V: q, k, v, the cache's rope rows in; out, lse out."""
    T = B * n
    nbytes = T * H * ((DN + R) + DN + DV + DV) * BF16 + T * R * BF16 + T * H * 4
    return {"op": "prefill kernel", "shape": f"B={B} n={n} H={H}", "bytes": nbytes,
            "flops": 2 * (B * n * (n + 1) // 2) * H * (DN + R + DV)}


def prefill_full_call(B: int, n: int, H: int = PREFILL_H) -> dict:
    """Gather + up-projection (latent rows and weights in, K/V out) + the flash kernel."""
    T = B * n
    kernel = prefill_kernel_call(B, n, H)
    up_bytes = T * L * BF16 + H * (DN + DV) * L * BF16 + T * H * (DN + DV) * BF16
    return {"op": "prefill full", "shape": kernel["shape"], "bytes": kernel["bytes"] + up_bytes,
            "flops": kernel["flops"] + 2 * T * L * H * (DN + DV)}


def write_call(T: int = WRITE_T, H: int = PREFILL_H) -> dict:
    """RMSNorm + RoPE + scatter: q read and written, kv in, the cache entry and cos/sin."""
    nbytes = 2 * T * H * (DN + R) * BF16 + T * (L + R) * BF16 + T * (L + R) * BF16 + T * R * 4
    return {"op": "cache write", "shape": f"T={T} H={H}", "bytes": nbytes, "flops": 0}


def calls() -> list[dict]:
    out = [decode_call(*s) for s in DECODE]
    out += [decode_call(*s, cache_format=f) for f in ("fp8_ds_mla", "fp8_e4m3") for s in FP8_DECODE]
    out += [prefill_kernel_call(*s) for s in PREFILL] + [prefill_full_call(*s) for s in PREFILL]
    return out + [write_call()]


def bound(call: dict, device: Device) -> dict:
    """Time in microseconds the device's ceilings allow, and which ceiling sets it."""
    t_mem = call["bytes"] / (device.hbm_GBps * 1e9)
    t_math = call["flops"] / (device.bf16_TFLOPs * 1e12)
    return {"us": round(max(t_mem, t_math) * 1e6, 2), "bound": "memory" if t_mem >= t_math else "compute"}


def table() -> list[dict]:
    return [{**c, "flop_per_byte": round(c["flops"] / c["bytes"], 1), **{d.name: bound(c, d) for d in DEVICES}}
            for c in calls()]


def print_table(rows: list[dict]) -> None:
    head = " ".join(f"{d.name:>17s}" for d in DEVICES)
    print(f"\nstatic roofline (published HBM bandwidth / dense bf16 rate)\n{'op':15s} {'shape':34s} {'MB':>9s} {'GFLOP':>9s} "
          f"{'F/B':>6s} {head}")
    for r in rows:
        cells = " ".join(f"{r[d.name]['us']:>10.1f} us {r[d.name]['bound'][:3]}" for d in DEVICES)
        print(f"{r['op']:15s} {r['shape']:34s} {r['bytes'] / 1e6:9.1f} {r['flops'] / 1e9:9.1f} {r['flop_per_byte']:6.1f} {cells}")
