"""Names and limits that more than one module uses, defined once."""

# Tensor formats of q, k, v (and of the modules' inputs).
TENSOR_FORMATS = ("sbhd", "bshd", "thd")

# The flash binding's format numbers (csrc/flash_api.cpp).
FLASH_FORMAT_CODES = {"bshd": 0, "sbhd": 1, "thd": 2}
# Head dims the flash kernels are built for (transformer_fa_flash.HEAD_DIMS); a smaller
# multiple of 8 runs on the next one up.
FLASH_HEAD_DIMS = (64, 128, 192, 256)
FLASH_MAX_HEAD_DIM = FLASH_HEAD_DIMS[-1]
# (head_dim_qk, head_dim_v) pairs FusedAttention's GPU tests cover.
FUSED_HEAD_DIMS = frozenset({(d, d) for d in (32, 64, 80, 96, 128, 160, 192, 256)}
                            | {(192, 128)})
# CUDA's limit on a grid's y and z dims: the flash kernels put sequences and heads there.
MAX_GRID_YZ = 65535

# Environment variables (TE's names where TE has them).
ENV_FLASH_ATTN = "NVTE_FLASH_ATTN"
ENV_FUSED_ATTN = "NVTE_FUSED_ATTN"
ENV_UNFUSED_ATTN = "NVTE_UNFUSED_ATTN"
ENV_DEBUG = "NVTE_DEBUG"
ENV_DEBUG_LEVEL = "NVTE_DEBUG_LEVEL"
ENV_ALLOW_NONDETERMINISTIC_ALGO = "NVTE_ALLOW_NONDETERMINISTIC_ALGO"
ENV_FLASH_KERNELS = "TRANSFORMER_FA_FLASH_KERNELS"  # the kernel set setup.py builds
# The flash forward's kernel family: unset or "auto" (the fastest that serves the call),
# "sm80" or "sm90" (tests and benchmarks compare them).
ENV_FLASH_FAMILY = "TRANSFORMER_FA_FLASH_FAMILY"
# The flash backward's kernel family (the same values): auto runs the sm90 backward
# (csrc/flash/sm90/bwd_*) where it serves the call on an sm_90 GPU (it measured faster than
# sm80 there), sm80 elsewhere. A requested sm90 backward that cannot serve a call fails in the
# binding with the reason (bwd_family in csrc/flash_api.cpp).
ENV_FLASH_BWD_FAMILY = "TRANSFORMER_FA_FLASH_BWD_FAMILY"
FLASH_FAMILIES = {"auto": 0, "sm80": 80, "sm90": 90}
