"""The routing kernels compiled for a GPU on a machine without one: the interpreter runs code
that the GPU compiler rejects (tests compile every kernel this way), and the compiled kernel says
what a launch shape costs in registers (benchmarks/kernel_resources.py)."""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import launch

# the type of every kernel argument that is not a constexpr, by name (sources and outputs as bf16)
ARGUMENT_TYPES = dict(
    table="*i64", readers="*i64", reads="*i64", num_sources="i32", num_kept="i32", num_second="i32", num_readers="i32",
    num_reads="i32", first="i32", T="i32", programs="i32", rows="i32", eps="fp32",
    **dict.fromkeys(("src0_ptr", "src_ptr", "null_ptr", "q_ptr", "g_ptr", "gate_ptr", "residual_ptr", "out_ptr",
                     "dout_ptr", "dout0_ptr", "grad_in_ptr", "dsrc_ptr", "q2_ptr", "g2_ptr", "dout2_ptr", "partner_ptr",
                     "dgate_ptr", "grad_mix_ptr"), "*bf16"),
    **dict.fromkeys(("lse_ptr", "stat0_ptr", "total_ptr", "gq_ptr", "partial_ptr", "prefix_acc_ptr",
                     "prefix_stat_ptr", "lse2_ptr", "total2_ptr", "partner_acc_ptr", "partner_norm_ptr",
                     "init_acc_ptr", "init_norm_ptr", "terms_ptr", "terms2_ptr", "partials_ptr", "lse_grad_ptr",
                     "total_lse_ptr", "grad_lse_ptr"), "*fp32"),
)


def compile_kernel(kernel, flags: dict, width: int, heads: int, rows: int, warps: int, stages: int = 3,
                   split: int = 1, capability: int = 90):
    """`kernel` built for CUDA compute capability `capability` (default Hopper) with these flags
    (the HAS_* constexprs, and IN_PLACE and PTX, by default as on a GPU; those it does not take
    are ignored), tile, launch shape and column blocks per head (launch.column_blocks)."""
    block_p, block_d = launch.current().partials_tile["read"]
    constants = {"IN_PLACE": True, "PTX": True, "HAS_LSE_GRAD": False, **flags, **launch.tile(width, heads),
                 "SPLIT": split, "BLOCK_T": rows, "STAGES": stages, "BLOCK_P": block_p, "BLOCK_D": block_d}
    constexprs = {name: value for name, value in constants.items() if name in kernel.arg_names}
    signature = {name: ARGUMENT_TYPES.get(name, "constexpr") for name in kernel.arg_names}
    return triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", capability, 32),
                          options=dict(num_warps=warps))
