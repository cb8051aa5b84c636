"""Which transformer_fa name serves each TE name that TE's tests import.

MODULES maps a TE module name to a ``Module``:
  target  the transformer_fa module serving the same purpose (its names are looked up there);
  absent  the feature a TE module belongs to when transformer_fa lacks it: every name not
          found otherwise (or every name, if target does not import) is a placeholder
          (see _shim.py) that records its use;
  names   per-name entries, looked up first: "module:attr" (a transformer_fa object, or one of
          the few stand-ins in _standins.py) or a reason from reasons.py (a placeholder).
A name found nowhere raises ImportError at collection, so a new TE import shows up at once.
"""
from typing import Dict, NamedTuple, Optional

from reasons import FP8, KV_CACHE, PARALLELISM, TE_API

CPP_EXTENSION = TE_API  # transformer_engine_torch, TE's C++ extension, and its wrappers


class Module(NamedTuple):
    target: Optional[str] = None
    absent: Optional[str] = None
    names: Dict[str, str] = {}


_UTILS = "transformer_fa.utils"
_STANDINS = "transformer_engine._standins"

MODULES = {
    "transformer_engine.common": Module(),
    # The recipes are FP8's; transformer_fa.common.recipe gives TE's classes (FP8 off).
    "transformer_engine.common.recipe": Module(target="transformer_fa.common.recipe", absent=FP8),
    "transformer_engine.pytorch": Module(target="transformer_fa", names={
        **{n: FP8 for n in ("Float8Quantizer", "Float8CurrentScalingQuantizer", "MXFP8Quantizer",
                            "Quantizer", "QuantizedTensor")},
        "DType": CPP_EXTENSION,
        "InferenceParams": KV_CACHE,
    }),
    "transformer_engine.pytorch.utils": Module(target=_UTILS),
    "transformer_engine.pytorch.attention": Module(target="transformer_fa.attention"),
    "transformer_engine.pytorch.attention.dot_product_attention": Module(names={
        "_attention_backends": f"{_STANDINS}:_attention_backends",
    }),
    "transformer_engine.pytorch.attention.dot_product_attention.utils": Module(names={
        "check_set_window_size": "transformer_fa.attention.masks:check_set_window_size",
        "get_attention_backend": f"{_STANDINS}:get_attention_backend",
        "AttentionParams": f"{_STANDINS}:TEAttentionParams",
        "AttentionLogging": f"{_STANDINS}:AttentionLogging",
        # flash-attn package version policy; our FlashAttention is this repo's kernels.
        "FlashAttentionUtils": f"{_STANDINS}:FlashAttentionUtils",
        "_get_supported_versions": TE_API,
    }),
    "transformer_engine.pytorch.quantization": Module(absent=FP8, names={
        "FP8GlobalStateManager": f"{_STANDINS}:FP8GlobalStateManager",
    }),
    "transformer_engine.pytorch.quantized_tensor": Module(absent=FP8),
    "transformer_engine.pytorch.constants": Module(absent=FP8),
    "transformer_engine.pytorch._extra_state": Module(absent=FP8),
    "transformer_engine.pytorch.distributed": Module(target="transformer_fa.distributed",
                                                     absent=PARALLELISM),
    "transformer_engine.pytorch.module": Module(),
    "transformer_engine.pytorch.module.base": Module(absent=TE_API),
    "transformer_engine.pytorch.cpp_extensions": Module(absent=CPP_EXTENSION),
    "transformer_engine.pytorch.cpp_extensions.fused_attn": Module(absent=CPP_EXTENSION, names={
        "FusedAttnBackend": f"{_STANDINS}:FusedAttnBackend",
    }),
    "transformer_engine_torch": Module(absent=CPP_EXTENSION),
}
