"""cudnn-frontend: the import, versions, handles per device, workspaces per stream."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

_cudnn = None
_import_error: Optional[str] = None


def get() -> Optional[object]:
    """The cudnn module, or None (``import_error()`` says why)."""
    global _cudnn, _import_error
    if _cudnn is None and _import_error is None:
        try:
            import cudnn

            _cudnn = cudnn
        except Exception as exc:  # ImportError, or a broken install raising anything
            _import_error = f"{type(exc).__name__}: {exc}"
    return _cudnn


def import_error() -> Optional[str]:
    return _import_error


def backend_version() -> Optional[Tuple[int, int, int]]:
    cudnn = get()
    if cudnn is None:
        return None
    try:
        v = int(cudnn.backend_version())
    except Exception:
        return None
    # cuDNN 9 encodes major * 10000 + minor * 100 + patch.
    return (v // 10000, (v % 10000) // 100, v % 100)


def versions() -> Dict[str, str]:
    """cuDNN backend and frontend versions, for the ``Running with config=...`` log line."""
    cudnn = get()
    if cudnn is None:
        return {}
    out = {"cudnn_frontend_version": str(getattr(cudnn, "__version__", "unknown"))}
    ver = backend_version()
    if ver is not None:
        out["cudnn_backend_version"] = ".".join(map(str, ver))
    return out


_handles: Dict[int, object] = {}
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(device_index: int) -> int:
    if _raw_stream is not None:
        return _raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


def handle(device_index: int, stream: Optional[int] = None):
    """The cuDNN handle of a device, set to torch's current stream there."""
    h = _handles.get(device_index)
    if h is None:
        with torch.cuda.device(device_index):
            h = _cudnn.create_handle()
        _handles[device_index] = h
    _cudnn.set_stream(h, current_stream(device_index) if stream is None else stream)
    return h


def release_handles() -> None:
    _handles.clear()


# Small workspaces are kept per (device, stream) and reused: launches on one stream run in
# order, so a buffer is free again for the next launch there. Large ones come from torch's
# allocator each call (their kernels take long enough for the allocation not to matter).
_WORKSPACE_KEEP_MAX = 8 << 20
_workspaces: Dict[Tuple[int, int], torch.Tensor] = {}


def workspace(size: int, device_index: int, stream: int) -> torch.Tensor:
    if size > _WORKSPACE_KEEP_MAX or torch.cuda.is_current_stream_capturing():
        return torch.empty(size, dtype=torch.uint8, device=torch.device("cuda", device_index))
    key = (device_index, stream)
    ws = _workspaces.get(key)
    if ws is None or ws.numel() < size:
        ws = torch.empty(max(size, 1 << 16), dtype=torch.uint8,
                         device=torch.device("cuda", device_index))
        _workspaces[key] = ws
    return ws


def release_workspaces() -> None:
    _workspaces.clear()


def data_type(dtype: torch.dtype):
    return _cudnn.data_type.HALF if dtype == torch.float16 else _cudnn.data_type.BFLOAT16
