"""Why a TE test or name has no transformer_fa counterpart (shared by the shim and deselect.py)."""
FP8 = "FP8"
PARALLELISM = "parallelism"
KV_CACHE = "KV cache"
TE_API = "TE-internal API with no equivalent"

ALL = (FP8, PARALLELISM, KV_CACHE, TE_API)

# Not a deselect reason: what the plugin reports for a test that stops at its first CUDA call
# on a machine without CUDA.
NEEDS_CUDA = "needs CUDA"
