"""The three compile targets and the per-SM / per-CU limits their occupancy is computed from.

Every constant is a published number; its source is the comment on its line. Occupancy is the
share of the hardware's wave (warp) slots the kernel's registers, shared memory (LDS) and block
size leave usable, computed the way NVIDIA's occupancy calculator and LLVM's AMDGPU backend do.
"""

from __future__ import annotations

from dataclasses import dataclass


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


@dataclass(frozen=True)
class NvidiaLimits:
    """Per-SM limits shared by compute capability 9.0 (H100, H200) and 10.0 (B200)."""

    regs_per_sm: int = 65536  # CUDA C++ Programming Guide, Technical Specifications per Compute Capability (9.0, 10.0)
    reg_alloc_unit: int = 256  # registers per warp allocation unit (CUDA toolkit cuda_occupancy.h, cc >= 3)
    sub_partitions: int = 4  # register file split in 4 sub-partitions (cuda_occupancy.h, cc >= 7)
    smem_granule: int = 128  # shared memory allocation granularity in bytes (cuda_occupancy.h, cc >= 7)
    smem_per_sm: int = 228 * 1024  # CUDA C++ Programming Guide, Technical Specifications (9.0, 10.0): 228 KB per SM
    smem_per_block: int = 227 * 1024  # same table: 227 KB maximum shared memory per thread block
    smem_reserved_per_block: int = 1024  # CUDA C++ Programming Guide, Shared Memory (cc >= 8.0): 1 KB reserved per block
    max_warps_per_sm: int = 64  # same table: 64 resident warps per SM
    max_blocks_per_sm: int = 32  # same table: 32 resident blocks per SM

    def occupancy(self, regs: int, smem: int, num_warps: int) -> dict:
        """Resident blocks and warps per SM, the fraction of warp slots, and what limits it."""
        regs_per_warp = _round_up(max(regs, 1) * 32, self.reg_alloc_unit)
        warps_by_regs = (self.regs_per_sm // self.sub_partitions // regs_per_warp) * self.sub_partitions
        smem_per_block = _round_up(smem + self.smem_reserved_per_block, self.smem_granule)
        limits = {
            "registers": warps_by_regs // num_warps,
            "shared memory": self.smem_per_sm // smem_per_block,
            "warps": self.max_warps_per_sm // num_warps,
            "blocks": self.max_blocks_per_sm,
        }
        limiter = min(limits, key=limits.get)
        blocks = limits[limiter]
        return {"blocks_per_sm": blocks, "warps_per_sm": blocks * num_warps,
                "occupancy": blocks * num_warps / self.max_warps_per_sm, "limiter": limiter}

    def smem_ok(self, smem: int) -> bool:
        return smem <= self.smem_per_block


@dataclass(frozen=True)
class AmdLimits:
    """Per-SIMD / per-CU limits of gfx942 (MI300X, CDNA3)."""

    vgprs_per_lane: int = 512  # LLVM AMDGPUUsage, gfx90a/gfx942: 512 unified (arch + acc) VGPRs per SIMD lane
    vgpr_granule: int = 8  # LLVM AMDGPU (getVGPRAllocGranule), gfx90a/gfx942 unified register file: 8
    sgprs_per_simd: int = 800  # LLVM AMDGPU (getTotalNumSGPRs), GFX9: 800 SGPRs per SIMD
    sgpr_granule: int = 16  # LLVM AMDGPU (getSGPRAllocGranule), GFX9: 16
    max_waves_per_simd: int = 8  # LLVM AMDGPU (getMaxWavesPerEU), gfx90a/gfx942: 8; matches LLVM's "; Occupancy:" here
    simds_per_cu: int = 4  # AMD CDNA3 ISA Reference Guide: 4 SIMD units per compute unit
    lds_per_cu: int = 64 * 1024  # AMD Instinct MI300 CDNA3 white paper: 64 KB local data share per CU
    lds_per_workgroup: int = 64 * 1024  # AMD CDNA3 ISA Reference Guide: a work-group allocates at most 64 KB of LDS

    def occupancy(self, vgprs: int, sgprs: int, lds: int, num_warps: int) -> dict:
        """Waves per SIMD, the fraction of wave slots, and what limits it (``num_warps``: waves per
        work-group, spread over the CU's SIMDs)."""
        limits = {
            "waves": self.max_waves_per_simd,
            "VGPRs": self.vgprs_per_lane // _round_up(max(vgprs, 1), self.vgpr_granule),
            "SGPRs": self.sgprs_per_simd // _round_up(max(sgprs, 1), self.sgpr_granule),
        }
        if lds:  # work-groups that fit in the CU's LDS, each with ceil(num_warps / 4) waves on every SIMD
            limits["LDS"] = (self.lds_per_cu // lds) * -(-num_warps // self.simds_per_cu)
        limiter = min(limits, key=limits.get)
        waves = limits[limiter]
        return {"waves_per_simd": waves, "occupancy": waves / self.max_waves_per_simd, "limiter": limiter}

    def smem_ok(self, lds: int) -> bool:
        return lds <= self.lds_per_workgroup


@dataclass(frozen=True)
class Target:
    """One compile target: Triton's ``GPUTarget`` fields, the devices it stands for, its limits."""

    name: str
    backend: str
    arch: int | str
    warp_size: int
    devices: str
    limits: NvidiaLimits | AmdLimits

    @property
    def is_amd(self) -> bool:
        return self.backend == "hip"

    @property
    def gpu_kind(self) -> str:
        """The backend's name for the vendor (``_common.gpu_kind``): which tile configs it picks."""
        return "amd" if self.is_amd else "nvidia"

    def gpu_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget(self.backend, self.arch, self.warp_size)


TARGETS = {
    "sm_90": Target("sm_90", "cuda", 90, 32, "H100, H200", NvidiaLimits()),
    "sm_100": Target("sm_100", "cuda", 100, 32, "B200", NvidiaLimits()),
    "gfx942": Target("gfx942", "hip", "gfx942", 64, "MI300X", AmdLimits()),
}
