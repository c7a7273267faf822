"""Rows of one buffer copied into rows of another in one call into the library
(``csrc/row_copy.cpp``): an offloaded layer's cache misses, bank rows into cache slots.

On CUDA the copies are queued on a copy stream through the CUDA driver the process already
loaded (torch's streams and events are the driver's), with the stream ordering and event
records around them in the same call: what took a torch call per row, a stream switch and two
event records from Python. On the CPU the same call is a memcpy per run of rows. The torch
twin (``dst[r].copy_(src[e])`` per row) is what ``moe/runtime.py`` falls back to and what the
tests compare with.

Threads: one copier per runtime, used from the engine's main thread (its descriptor and row
buffers are reused call to call).
"""

from __future__ import annotations

import ctypes
from functools import cache

import numpy as np
import torch

from freetoken.config.engine import MOE_CPU_SPIN_US
from freetoken.cpu import abi
from freetoken.cpu.library import NativeUnavailable, native

DRIVER = "libcuda.so.1"
ENTRY_POINTS = ("cuMemcpyAsync", "cuEventRecord", "cuStreamWaitEvent", "cuEventQuery",
                "cuEventSynchronize")


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # CUDA builds of torch


def current_stream(device: int) -> int:
    """The raw handle of torch's current CUDA stream on ``device`` (an index): what the
    copies go on, without torch's Stream object (a few microseconds less each time)."""
    if _RAW_STREAM is not None:
        return _RAW_STREAM(device)
    return torch.cuda.current_stream(device).cuda_stream


class Spans:
    """Copies between fixed buffers (``(dst, src)`` pairs as :meth:`RowCopier.copy_tensors`
    takes them), checked and laid out once and queued by :meth:`RowCopier.run` as often as
    needed: a host step's input copies, a slot table's publish. The tensors are kept alive
    with it and must not move (static graph buffers and pinned host memory do not)."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        n = len(pairs)
        self.table = np.zeros((3, n), dtype=np.int64)  # dst, src addresses; bytes
        for i, (dst, src) in enumerate(pairs):
            nbytes = dst.numel() * dst.element_size()
            if (src.numel() * src.element_size() != nbytes or not dst.is_contiguous()
                    or not src.is_contiguous()):
                raise ValueError(f"copy {i}: {tuple(src.shape)} {src.dtype} into "
                                 f"{tuple(dst.shape)} {dst.dtype} is not a contiguous copy of "
                                 "equal bytes")
            self.table[:, i] = dst.data_ptr(), src.data_ptr(), nbytes
        self.n = n
        self.pointers = tuple(int(self.table[k].ctypes.data) for k in range(3))
        self.keep = pairs


class RowCopyError(RuntimeError):
    """The CUDA driver refused a copy or an event; the message has its error code."""


@cache
def driver_api() -> abi.RowCopyApi | str:
    """The CUDA driver's entry points for the copies, or why there are none."""
    try:
        lib = ctypes.CDLL(DRIVER)
    except OSError as e:
        return f"the CUDA driver ({DRIVER}) does not load: {e}"
    try:
        fns = [ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in ENTRY_POINTS]
    except AttributeError as e:
        return f"the CUDA driver lacks an entry point: {e}"
    return abi.RowCopyApi(*fns)


def driver_function(name: str, argtypes: list[type], restype: type = ctypes.c_int,
                    ) -> ctypes._CFuncPtr | str:
    """One entry point of the CUDA driver, typed, to call from Python (a graph's host node, a
    piece's launch), or why there is none."""
    try:
        fn = getattr(ctypes.CDLL(DRIVER), name)
    except (OSError, AttributeError) as e:
        return f"the CUDA driver has no {name}: {e}"
    fn.argtypes, fn.restype = argtypes, restype
    return fn


class RowCopier:
    """Queues row copies in one library call; ``cuda``: through the driver on streams."""

    def __init__(self, cuda: bool, max_rows: int = 1024) -> None:
        self.lib = native()
        if cuda:
            api = driver_api()
            if isinstance(api, str):
                raise NativeUnavailable(api)
            self.api = api
        else:
            self.api = abi.RowCopyApi()
        self._api = ctypes.byref(self.api)
        self.desc = abi.RowCopy()
        self._rows = np.zeros((2, max_rows), dtype=np.int32)  # dst rows, src rows
        self._done: torch.cuda.Event | None = None  # what a sync waits on (blocking)

    def _done_event(self) -> int:
        if self._done is None:
            self._done = torch.cuda.Event(blocking=True)
            self._done.record()  # made now, so that it has a handle
        return self._done.cuda_event

    def copy(self, dst: torch.Tensor, dst_rows: list[int], src: torch.Tensor,
             src_rows: list[int], compute_stream: int = 0, copy_stream: int = 0,
             ready: int = 0, start: int = 0, end: int = 0, compute_waits: bool = False) -> None:
        """Row ``dst_rows[i]`` of ``dst`` gets row ``src_rows[i]`` of ``src`` (2-D uint8,
        rows of equal bytes, contiguous rows). On CUDA: on ``copy_stream`` after the work
        queued on ``compute_stream`` so far (the event ``ready`` is recorded there and
        waited for), with the events ``start`` / ``end`` recorded around the copies and, with
        ``compute_waits``, the compute stream waiting for ``end``. Streams and events are raw
        handles (``torch.cuda.Stream.cuda_stream``, ``torch.cuda.Event.cuda_event``)."""
        n = len(dst_rows)
        if n != len(src_rows):
            raise ValueError(f"{n} destination rows for {len(src_rows)} source rows")
        if (dst.shape[1] != src.shape[1] or dst.dtype != torch.uint8 or src.dtype != torch.uint8
                or dst.stride(1) != 1 or src.stride(1) != 1):
            raise ValueError("row copies need contiguous uint8 rows of one size on both sides")
        if n > self._rows.shape[1]:
            self._rows = np.zeros((2, 2 * n), dtype=np.int32)
        rows = self._rows
        rows[0, :n] = dst_rows
        rows[1, :n] = src_rows
        d = self.desc
        d.dst, d.dst_stride = dst.data_ptr(), dst.stride(0)
        d.src, d.src_stride = src.data_ptr(), src.stride(0)
        d.row_bytes, d.n, d.compute_waits = dst.shape[1], n, int(compute_waits)
        d.dst_rows, d.src_rows = rows[0].ctypes.data, rows[1].ctypes.data
        d.compute_stream, d.copy_stream = compute_stream or None, copy_stream or None
        d.ev_ready, d.ev_start, d.ev_end = ready or None, start or None, end or None
        err = self.lib.ft_copy_rows(self._api, ctypes.byref(d))
        if err:
            raise RowCopyError(f"copying {n} expert rows failed: CUDA driver error {err}")

    def copy_tensors(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], stream: int = 0,
                     sync: bool = False) -> None:
        """Each ``(dst, src)`` pair (contiguous, of equal bytes: a host buffer and a device
        one, either way) copied in order on ``stream`` (a raw handle; 0: the legacy default
        stream); with ``sync`` the host then waits for the stream (as ``cpu/gpu_wait.py``
        does: a bounded spin, then asleep). On the CPU: memcpy."""
        self.run(Spans(pairs), stream, sync)

    def run(self, spans: Spans, stream: int = 0, sync: bool = False) -> None:
        """The copies of ``spans``, as :meth:`copy_tensors` makes them."""
        dst, src, nbytes = spans.pointers
        done = self._done_event() if sync and self.api.memcpy_async else None
        err = self.lib.ft_copy_spans(self._api, stream or None, spans.n, dst, src, nbytes,
                                     done, MOE_CPU_SPIN_US)
        if err:
            raise RowCopyError(f"copying {spans.n} buffers failed: CUDA driver error {err}")
