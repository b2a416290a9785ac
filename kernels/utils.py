"""Helpers shared by the Triton kernels: interpreter detection and varlen index math.

Kernels here run compiled on CUDA tensors and in Triton's interpreter (TRITON_INTERPRET=1) on
CPU tensors, which is how CI checks them against `kernels/ref`. The interpreter computes bf16
arithmetic on bit patterns, so kernels cast loads to fp32 before math whenever `INTERPRET` is
set (on the GPU they keep bf16 operands for tl.dot).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# the kernel families that may launch with programmatic dependent launch (`pdl`), by module:
# the dense GEMV, the int4 experts' launches, the mHC sites, the router and its top-k, the
# KDA mixer and gated norm
PDL_FAMILIES = ("linear", "int4", "mhc", "router", "kda")


def pdl_families(setting: str) -> frozenset[str]:
    """The families GLM53_PDL turns on: "0" (or empty) none, "1" all, else a comma-separated
    list of PDL_FAMILIES (to find which family a fault follows)."""
    setting = setting.strip()
    if setting in ("", "0"):
        return frozenset()
    if setting == "1":
        return frozenset(PDL_FAMILIES)
    names = frozenset(name.strip() for name in setting.split(","))
    if unknown := names - set(PDL_FAMILIES):
        raise ValueError(f"GLM53_PDL={setting!r}: unknown kernel families {sorted(unknown)}; "
                         f"give 0, 1 or a comma-separated list of {', '.join(PDL_FAMILIES)}")
    return names


# programmatic dependent launch (`pdl`): on with GLM53_PDL=1 (or for some families). On an
# H100 its gpu tests pass and the 24-layer rank-0 replay took 4.45 ms against 4.56 without at
# batch 1 (45.95 / 46.07 at 64: rank0_l24_h100_int4_pdl_da29b95.json), but with it on, an
# equality test of the overlapped graph engine against the eager one (test_gpu_cuda_graphs.py,
# adaptive widths) failed in 1 run of 6 at 1346cd0, its failing assert not captured: off by
# default until `scripts/gpu_check.sh graphs` says whether PDL is the cause, and which family
PDL = pdl_families(os.environ.get("GLM53_PDL", "0"))


@functools.cache
def device_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) compute capability of `device`, asked once per device (wrappers that key a
    tiling on it run on every step)."""
    return torch.cuda.get_device_capability(device)


@functools.cache
def num_sms(device: torch.device) -> int:
    """SMs of `device`, asked once (the decode launches size their grids from it every step);
    an H100's / H200's 132 off CUDA (the interpreter's grids follow the GPU's)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def is_sm120(device: torch.device) -> bool:
    """Whether kernels for `device` compile for consumer/workstation Blackwell (compute capability
    12.x: RTX PRO 6000, RTX 50xx): 99 KB of shared memory per block (Hopper 227 KB) and mma.sync,
    whose operands sit in registers (no wgmma), so a Hopper tiling of a tensor-core kernel may
    not fit. Never in the interpreter, whose tilings are its own."""
    return not INTERPRET and device_capability(device)[0] == 12


def pdl(device: torch.device, family: str) -> bool:
    """Whether decode kernels on `device` launch with programmatic dependent launch (sm_90+):
    such a kernel is let onto the SMs while the one before it in the stream still runs (every
    one of its programs has called `pdl_start`), and waits in `pdl_wait` for it to finish and
    its writes to show. So what costs a kernel boundary in a decode step of ~600 launches, the
    launch and the ramp of the next grid and whatever it reads that no kernel writes (weights),
    overlaps the tail of the last. A kernel launched so must call `pdl_wait` before it reads
    anything an earlier kernel wrote and before it writes anything (an earlier kernel may still
    read it); kernels after it need nothing: they start when it ends, after its wait. Never in
    the interpreter (inline PTX) or off CUDA, nor unless `family` (PDL_FAMILIES) is in `PDL`
    (GLM53_PDL)."""
    return (family in PDL and not INTERPRET and device.type == "cuda"
            and device_capability(device)[0] >= 9)


def pdl_early(device: torch.device, family: str,
              *operands: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """`pdl(device, family)` for a kernel that reads some operands before its wait: each
    (given, passed) pair must be one tensor, the caller's own (a weight), not a cast copy that
    the kernel just before has made."""
    return pdl(device, family) and all(given is passed for given, passed in operands)


@triton.jit
def pdl_start(ON: tl.constexpr):
    """Let the next kernel's programs onto the SMs (`pdl`); a no-op unless ON."""
    if ON:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(ON: tl.constexpr):
    """Wait for the kernels before this one to finish, their writes visible (`pdl`); a no-op
    unless ON."""
    if ON:
        gdc_wait()


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def log2_ceil(n: int) -> int:
    """Steps of a binary search over n + 1 boundaries (at least 1)."""
    return max(1, (int(n)).bit_length())


@triton.jit
def seq_of_token(o_t, cu_seqlens, N, LOG_N: tl.constexpr):
    """Sequence index of each token in `o_t` ([BT] int): the largest i < N with
    cu_seqlens[i] <= t (so an empty sequence never owns a token)."""
    i_lo = tl.zeros_like(o_t)
    i_hi = tl.zeros_like(o_t) + (N - 1)
    for _ in tl.static_range(LOG_N):
        i_mid = (i_lo + i_hi + 1) // 2
        b_b = tl.load(cu_seqlens + i_mid, mask=i_mid <= N, other=0)
        ok = b_b <= o_t
        i_lo = tl.where(ok, i_mid, i_lo)
        i_hi = tl.where(ok, i_hi, i_mid - 1)
    return i_lo
