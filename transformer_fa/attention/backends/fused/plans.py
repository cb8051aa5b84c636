"""Built graphs (plans) and the one cache that the support check and the plan builder share.

The support check validates a graph described from params (cuDNN's check_support, no plan
build) and keeps it; the first call with that description builds the plans of that same
graph instead of making it again. Both go through GraphCache, passed explicitly.
"""
from __future__ import annotations

import collections
import logging
import time
from typing import Callable, Dict, Optional, Sequence

import torch

from ..support import strides_aligned
from . import cudnn_lib, graph
from .graph import make_graph, ragged_strides
from .spec import Spec

logger = logging.getLogger("DotProductAttention")

CACHE_SIZE = 256  # plans kept per direction (forward, backward)
CONTIGUOUS = object()  # plan marker: these strides failed; run on contiguous copies


class Plan:
    __slots__ = ("graph", "exec", "ws", "q_mult", "kv_mult", "zero", "spec", "device")

    def __init__(self, g, spec: Spec, device_index: int, fast_execute: bool):
        """g: spec's graph, validated, with its plans not built yet."""
        start = time.perf_counter()
        g.build_plans()
        self.graph = g
        self.spec = spec
        self.device = device_index
        self.ws = int(g.get_workspace_size())
        self.exec = _executor(g, fast_execute)
        q_side, kv_side = ragged_strides(spec)
        dev = torch.device("cuda", device_index)
        self.q_mult = (torch.tensor(q_side, dtype=torch.int64, device=dev).view(-1, 1)
                       if q_side else None)
        self.kv_mult = (torch.tensor(kv_side, dtype=torch.int64, device=dev).view(-1, 1)
                        if kv_side else None)
        # Rows no query or key reaches (padding) are zero in outputs and gradients.
        self.zero = spec.padding
        logger.debug("FusedAttention: built the cuDNN %s graph in %.1f ms (b=%d, hq=%d, hkv=%d, "
                     "sq=%d, skv=%d, d=%d/%d, %s, workspace %d bytes)",
                     "backward" if spec.backward else "forward",
                     (time.perf_counter() - start) * 1e3, spec.b, spec.hq, spec.hkv, spec.sq,
                     spec.skv, spec.dqk, spec.dv, str(spec.dtype).replace("torch.", ""), self.ws)

    def run(self, pack: Dict[int, int], cu_q, cu_kv, device: torch.device) -> None:
        keep = []  # temporaries that must live until the launch
        if self.spec.padding:
            seq_q = cu_q[1:] - cu_q[:-1]
            seq_kv = seq_q if cu_kv is cu_q else cu_kv[1:] - cu_kv[:-1]
            pack[graph.SEQ_Q] = seq_q.data_ptr()
            pack[graph.SEQ_KV] = seq_kv.data_ptr()
            keep += (seq_q, seq_kv)
            if self.q_mult is not None:
                offs = cu_q.unsqueeze(0) * self.q_mult  # int64 [n, b+1], one row per stride
                base, step = offs.data_ptr(), offs.stride(0) * 8
                for i in range(offs.shape[0]):
                    pack[graph.RAGGED_Q_BASE + i] = base + i * step
                keep.append(offs)
            if self.kv_mult is not None:
                offs = cu_kv.unsqueeze(0) * self.kv_mult
                base, step = offs.data_ptr(), offs.stride(0) * 8
                for i in range(offs.shape[0]):
                    pack[graph.RAGGED_KV_BASE + i] = base + i * step
                keep.append(offs)
        stream = cudnn_lib.current_stream(self.device)
        ws = cudnn_lib.workspace(self.ws, self.device, stream) if self.ws else None
        if torch.cuda.current_device() != self.device:
            with torch.cuda.device(self.device):
                self.exec(pack, ws.data_ptr() if ws is not None else 0,
                          cudnn_lib.handle(self.device, stream))
        else:
            self.exec(pack, ws.data_ptr() if ws is not None else 0, cudnn_lib.handle(self.device, stream))


def _executor(g, fast: bool):
    """How to launch a built graph: straight into the backend graph (lean), else the public
    ``pygraph.execute``."""
    def public(pack, ws, handle):
        g.execute(pack, ws or None, handle=handle)

    if not fast:
        return public
    try:
        if g.selected_engine is not None:  # a python engine: only execute() knows it
            return public
        lowered = g._lowered_graph
        cpp_index = g._plans[g._plan_index].cpp_index
        if cpp_index is None:
            run_plan = lowered._execute

            def fast(pack, ws, handle):
                run_plan(pack, ws, handle.backend_handle)
        else:
            run_plan = lowered._execute_plan_at_index

            def fast(pack, ws, handle):
                run_plan(pack, ws, cpp_index, handle.backend_handle)
        return fast
    except Exception:  # another cudnn-frontend version: keep to the public API
        return public




class GraphCache:
    """Support verdicts, the graphs the support check validated, and the built plans.

    verdict() serves the support check; plan() serves the calls, and builds the graph the
    support check validated for the same Spec when it has it. fast_execute: launch through
    the backend graph's own execute (else the public ``pygraph.execute``: same plan, more
    host time); it applies to plans built after it is set.
    """

    def __init__(self, size: int = CACHE_SIZE, fast_execute: bool = True):
        self.size = size
        self.fast_execute = fast_execute
        self.verdicts: "collections.OrderedDict[tuple, Optional[str]]" = collections.OrderedDict()
        self.validated: "collections.OrderedDict[tuple, object]" = collections.OrderedDict()
        self.forward: "collections.OrderedDict[tuple, object]" = collections.OrderedDict()
        self.backward: "collections.OrderedDict[tuple, object]" = collections.OrderedDict()

    def verdict(self, spec: Spec, device_index: int) -> Optional[str]:
        """cuDNN's verdict on a graph description: None (supported), or its message."""
        key = (spec, device_index)
        if key in self.verdicts:
            self.verdicts.move_to_end(key)
            return self.verdicts[key]
        try:
            _put(self.validated, key, make_graph(spec, cudnn_lib.handle(device_index)), 64)
            verdict = None
        except Exception as exc:  # cudnnGraphNotSupportedError, ValueError, RuntimeError, ...
            verdict = " ".join(str(exc).split()) or type(exc).__name__
            if len(verdict) > 300:
                verdict = verdict[:300] + "..."
        _put(self.verdicts, key, verdict, 4 * self.size)
        return verdict

    def plan(self, table: "collections.OrderedDict", key: tuple, make_spec: Callable[[], Spec],
             tensors: Sequence[torch.Tensor]):
        """The Plan for key in table (self.forward or self.backward), built on a miss, or
        CONTIGUOUS: on a build failure with non-contiguous strides the key is marked so its
        calls run on contiguous copies (the support check was made with contiguous ones)."""
        plan = table.get(key)
        if plan is not None:
            table.move_to_end(key)
            return plan
        contiguous = all(t.is_contiguous() for t in tensors)
        if not contiguous and not all(strides_aligned(t) for t in tensors):
            _put(table, key, CONTIGUOUS, self.size)
            return CONTIGUOUS
        device_index = tensors[0].device.index
        try:
            with torch.cuda.device(device_index):
                spec = make_spec()
                g = self.validated.pop((spec, device_index), None)
                if g is None:
                    g = make_graph(spec, cudnn_lib.handle(device_index))
                plan = Plan(g, spec, device_index, self.fast_execute)
        except Exception as exc:
            if contiguous:
                raise RuntimeError(
                    f"FusedAttention: cuDNN could not build the graph: {exc}") from exc
            logger.debug("FusedAttention: cuDNN rejected the strided layout (%s); running on "
                         "contiguous copies", exc)
            plan = CONTIGUOUS
        _put(table, key, plan, self.size)
        return plan

    def clear(self) -> None:
        for table in (self.verdicts, self.validated, self.forward, self.backward):
            table.clear()


def _put(table: "collections.OrderedDict", key, value, limit: int) -> None:
    table[key] = value
    if len(table) > limit:
        table.popitem(last=False)


# The process's cache: the support check and the ops use this one.
CACHE = GraphCache()
