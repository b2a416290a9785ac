"""The ops the model calls, with a backend switch: the Triton kernel (`kernels/<module>.py`) on
CUDA tensors and the pure-torch reference (`kernels/ref/<module>.py`) otherwise, under the same
names and signatures. An op without a Triton twin yet (sampling, rejection) always runs its
reference; callers outside kernels/ still go through here, so a twin plugs in without touching them.

The choice is per call, from the device of the op's first argument (`use("auto")`, the
default); `use("triton")` forces the kernels (CPU tests run them under TRITON_INTERPRET=1) and
`use("ref")` forces the references. Triton is imported only when a kernel is first needed, so a
CPU box without it runs the references.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

from .ref.exl3 import exl3_dequant, moe_exl3
from .ref.int4 import dequantize_int4, moe_int4, quantize_int4
from .ref.kda import (
    causal_conv1d,
    conv_commit,
    gated_rms_norm,
    kda_attention,
    kda_commit,
    kda_gate,
    kda_gated_attention,
)
from .ref.kda_mixer import kda_mixer

# E4M3_MAX, check_outer_scale, row_bytes, fp8_row_bytes, fp8_row_parts: the byte layouts of
# quantised KV-cache rows, for the code that sizes caches, checks scale banks and reads fp8 rows
# (facts, not ops: no backend switch)
from .ref.latent_quant import (  # noqa: F401
    E4M3_MAX,
    check_outer_scale,
    fp8_row_bytes,
    fp8_row_parts,
    pack_fp8,
    row_bytes,
    store_latent,
)
from .ref.linear import linear, linear_swiglu
from .ref.mhc import hc_post, hc_post_pre, hc_pre
from .ref.moe import fused_moe, route_topk, router_logits, swiglu
from .ref.norm import rms_norm
from .ref.rejection import rejection_sample
from .ref.sampling import apply_penalties, process_logits, random_uniform, sample
from .ref.sparse_mla import (
    indexer_topk,
    indexer_update,
    merge_attention_states,
    sparse_mla_attention,
    store_rows,
)

__all__ = [
    "apply_penalties",
    "causal_conv1d",
    "conv_commit",
    "dequantize_int4",
    "exl3_dequant",
    "fused_moe",
    "gated_rms_norm",
    "hc_post",
    "hc_post_pre",
    "hc_pre",
    "indexer_topk",
    "indexer_update",
    "kda_attention",
    "kda_commit",
    "kda_gate",
    "kda_gated_attention",
    "kda_mixer",
    "linear",
    "linear_swiglu",
    "merge_attention_states",
    "moe_exl3",
    "moe_int4",
    "pack_fp8",
    "process_logits",
    "quantize_int4",
    "random_uniform",
    "rejection_sample",
    "rms_norm",
    "route_topk",
    "router_logits",
    "sample",
    "sparse_mla_attention",
    "store_latent",
    "store_rows",
    "swiglu",
]


# --- backend switch ---------------------------------------------------------------------------

# kernel modules: kernels/<name>.py holds the Triton twins of kernels/ref/<name>.py
KERNEL_MODULES = ("exl3", "int4", "kda", "kda_mixer", "latent_quant", "linear", "mhc", "moe",
                  "norm", "sparse_mla")
BACKENDS = ("auto", "triton", "ref")
_backend = "auto"
_triton: dict[str, Callable] | None = None


def use(backend: str) -> None:
    """Pick the backend for every op: "auto" (Triton on CUDA tensors), "triton" or "ref"."""
    global _backend
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS}")
    _backend = backend


def backend() -> str:
    return _backend


def triton_kernels() -> dict[str, Callable]:
    """name -> Triton implementation of every op that has one (empty without Triton)."""
    global _triton
    if _triton is None:
        found: dict[str, Callable] = {}
        for mod in KERNEL_MODULES:
            try:
                module = importlib.import_module(f"{__package__}.{mod}")
            except ImportError:
                continue
            found.update({name: getattr(module, name) for name in module.__all__})
        _triton = found
    return _triton


def _dispatching(name: str, ref: Callable) -> Callable:
    @functools.wraps(ref)
    def op(*args, **kwargs):
        if _backend != "ref" and (_backend == "triton" or getattr(args[0], "is_cuda", False)):
            fast = triton_kernels().get(name)
            if fast is not None:
                return fast(*args, **kwargs)
        return ref(*args, **kwargs)

    op.ref = ref
    return op


for _name in __all__:
    _ref = globals()[_name]
    if _ref.__module__.rsplit(".", 1)[-1] in KERNEL_MODULES:
        globals()[_name] = _dispatching(_name, _ref)
del _name, _ref
