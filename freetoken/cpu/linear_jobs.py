"""The CPU pool's dense-matrix jobs (``layers/pool_linear.py``'s matrices): a matrix registered
once in its own format, then ``x @ W^T`` submitted as a job or run in one library call, as the
executor's expert jobs are. A part of :class:`~freetoken.cpu.executor.CpuMoeExecutor`, which
holds the pool, its job slots and the library handle these methods use."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from freetoken.cpu.abi import ACT_KINDS, ISAS
from freetoken.cpu.expert_stack import ExpertStack
from freetoken.cpu.jobs import CpuMoeFuture


def as_host(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as a contiguous CPU tensor of dtype the workers may read: t itself when it is one (the
    checks cost a fraction of a no-op ``to``, and submit is on the decode path)."""
    if t.is_cpu and t.dtype is dtype and t.is_contiguous() and not t.requires_grad:
        return t
    return t.detach().to("cpu", dtype).contiguous()


class LinearJobs:
    """Dense matrices on the pool, by id (mixed into the executor, whose ``_take_slot``,
    ``_give_slot`` and ``_run_in_slot`` bound the jobs in flight as they do its MoE jobs)."""

    _lib: Any
    _handle: Any
    _act_mode: int
    _timing: bool
    _linears: list[ExpertStack]
    _take_slot: Any
    _give_slot: Any
    _run_in_slot: Any

    def add_linear(self, weight: ExpertStack) -> int:
        """Register a dense matrix (a one-expert stack, rows x cols); returns its id."""
        if weight.num_experts != 1:
            raise ValueError("a dense matrix is a stack of one")
        err = ctypes.create_string_buffer(512)
        lid = len(self._linears)
        desc = weight.desc()
        if self._lib.ft_add_linear(self._handle, lid, ctypes.byref(desc), self._act_mode, err,
                                   512) != 0:
            raise ValueError(f"dense {weight.fmt} {weight.rows}x{weight.cols}: "
                             f"{err.value.decode()}")
        self._linears.append(weight)
        return lid

    def linear_kernel(self, lid: int) -> tuple[str, str]:
        """(isa, activation kind) of dense matrix ``lid``'s kernel."""
        isa, act = ctypes.c_int(), ctypes.c_int()
        self._lib.ft_linear_kernel(self._handle, lid, ctypes.byref(isa), ctypes.byref(act))
        return ISAS[isa.value], ACT_KINDS[act.value]

    def linear_batch_isa(self, lid: int) -> str | None:
        """The tier of dense matrix ``lid``'s batched kernel, which jobs of
        :func:`~freetoken.cpu.library.batch_vectors` or more vectors run; None if it has none."""
        tier = self._lib.ft_linear_batch_isa(self._handle, lid)
        if tier == -2:
            raise ValueError(f"dense matrix {lid} is not registered")
        return ISAS[tier] if tier >= 0 else None

    def _check_linear(self, x: torch.Tensor, lid: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input, output) of dense matrix ``lid`` for x (T, cols), as the workers read them."""
        w = self._linears[lid]
        xf = as_host(x, torch.float32)
        if xf.dim() != 2 or xf.shape[1] != w.cols:
            raise ValueError(f"dense {w.rows}x{w.cols}: input {tuple(x.shape)}")
        if xf.shape[0] == 0:
            raise ValueError(f"dense {w.rows}x{w.cols}: the input has no rows")
        return xf, torch.empty(xf.shape[0], w.rows, dtype=torch.float32)

    def submit_linear(self, x: torch.Tensor, lid: int) -> CpuMoeFuture:
        """Start ``x @ W^T`` for x (T, cols) on the pool; the future's result is (T, rows)."""
        xf, out = self._check_linear(x, lid)
        self._take_slot()
        ticket = self._lib.ft_submit_linear(self._handle, lid, xf.data_ptr(), out.data_ptr(),
                                            xf.shape[0])
        if ticket < 0:
            self._give_slot()
            raise ValueError(f"dense matrix {lid} is not registered")
        return CpuMoeFuture(self, ticket, out, (xf,))

    def run_linear(self, x: torch.Tensor, lid: int) -> torch.Tensor:
        """submit_linear + wait in one call into the library (see :meth:`run`)."""
        if self._timing:
            return self.submit_linear(x, lid).wait()
        xf, out = self._check_linear(x, lid)
        done = self._run_in_slot(self._lib.ft_run_linear, lid, xf.data_ptr(), out.data_ptr(),
                                 xf.shape[0], None)
        if done < 0:
            raise ValueError(f"dense matrix {lid} is not registered")
        return out
