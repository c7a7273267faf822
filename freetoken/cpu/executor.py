"""The CPU MoE executor: a pool of pinned C++ workers that compute routed experts from host memory.

Experts stay in their own format (bf16, q8_0, q4_k, ...); the kernels in ``csrc/`` read them
directly, one weight row at a time for every token routed to the expert. The boundary is an
async pair: :meth:`CpuMoeExecutor.submit` hands a layer's routed batch to the pool and returns at
once (the call releases the GIL), :meth:`CpuMoeFuture.wait` blocks until the result is there, so
the caller (the GPU half of a hybrid step) works in between.

Threads: ``add_layer`` before the first ``submit``; ``submit``/``wait`` from any thread; every
submitted future must be waited, at most :data:`MAX_IN_FLIGHT` at a time per executor.
"""


from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch

from freetoken import env
from freetoken.config import MOE_CPU_SPIN_US
from freetoken.cpu.abi import (  # noqa: F401
    ACT_KINDS,
    EXPERT_FORMATS,
    FORMATS,
    ISAS,
    WORKER_FIELDS,
    WORKER_STATES,
    GluDesc,
)
from freetoken.cpu.cores import describe_cores, plan_cores, usable_cores
from freetoken.cpu.expert_stack import ExpertStack
from freetoken.cpu.host_memory import HUGE_PAGE, host_buffer, to_host_bank  # noqa: F401
from freetoken.cpu.jobs import CpuMoeFuture, JobTiming
from freetoken.cpu.library import (  # noqa: F401  (the executor's public names)
    ACTIVATIONS,
    EXPERT_ACTIVATIONS,
    LIBRARY,
    MAX_IN_FLIGHT,
    PROJECTIONS,
    NativeUnavailable,
    available,
    best_isa,
    expert_bytes,
    isa_cap_from_env,
    kernel_isa,
    native,
    quantize_q8,
    set_prefetch,
)
from freetoken.cpu.linear_jobs import LinearJobs, as_host
from freetoken.cpu.pool_controls import DOWN_SPLITS, PoolControls  # noqa: F401

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class LayerInfo:
    experts: int
    hidden: int
    intermediate: int
    fmts: tuple[str, str, str]
    kernels: tuple[tuple[str, str], ...]  # (isa, act kind) per projection


@dataclass(frozen=True)
class PreparedJob:
    """A MoE job's checked arguments (:meth:`CpuMoeExecutor.prepare`): the layer, the library
    call's pointers and sizes, its output and the inputs kept alive with it."""

    layer: int
    args: tuple[int, int, int, int, int, int]
    out: torch.Tensor
    keep: tuple[torch.Tensor, ...]


class CpuMoeExecutor(LinearJobs, PoolControls):
    """The pool and the expert banks of every MoE layer it serves.

    ``threads``: workers (``--moe-cpu-threads``); None is one per usable core but the first.
    ``isa``: the highest tier to use; None is FREETOKEN_CPU_ISA, else the best this CPU has.
    ``act``: how int formats read activations: "auto" (int8 blocks where a SIMD kernel does it
    that way), "f32", "q8"; None is FREETOKEN_CPU_ACT (else "auto").
    ``spin_us``: how long idle workers spin before sleeping on a futex (0: sleep at once). Waits
    between phases spin up to 2 ms and wait() up to 1 ms, both bounded, then block.
    """

    def __init__(
        self,
        threads: int | None = None,
        isa: str | None = None,
        spin_us: int = MOE_CPU_SPIN_US,
        act: str | None = None,
    ) -> None:
        lib = native()
        if act is None:
            act = env.cpu_act()
        if isa is None:
            isa = isa_cap_from_env()
        if isa is not None and isa not in ISAS:
            raise ValueError(f"unknown ISA {isa!r} (choose from {', '.join(ISAS)})")
        if act not in ("auto", "f32", "q8"):
            raise ValueError(f"unknown activation mode {act!r} (choose from auto, f32, q8)")
        self._act_mode = -1 if act == "auto" else ACT_KINDS.index(act)
        usable = usable_cores()
        self.cores = plan_cores(usable, threads)
        cap = ISAS.index(isa) if isa is not None else len(ISAS) - 1
        arr = (ctypes.c_int * len(self.cores))(*self.cores)
        self._lib = lib
        self._handle = lib.ft_executor_new(arr, len(self.cores), cap, spin_us)
        self.threads = lib.ft_executor_threads(self._handle)
        self.isa = ISAS[lib.ft_executor_isa(self._handle)]
        self.layers: dict[int, LayerInfo] = {}
        self._stacks: dict[int, tuple[ExpertStack, ...]] = {}
        self._linears: list[ExpertStack] = []  # dense matrices by id, kept alive
        self._lock = threading.Lock()
        self._in_flight = 0
        self._announced = False
        self._timing = False
        spare = max(1, len(usable) - len(set(self.cores)))
        self._torch_threads: int | None = None  # torch's count before the cap, for close()
        if torch.get_num_threads() > spare:
            log.info(
                "capping torch CPU threads at %d so they leave the MoE pool's cores alone", spare
            )
            self._torch_threads = torch.get_num_threads()
            torch.set_num_threads(spare)

    def add_layer(
        self,
        layer: int,
        gate: ExpertStack,
        up: ExpertStack,
        down: ExpertStack,
        activation: str = "silu",
        swiglu: tuple[float, float] | None = None,
        bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> LayerInfo:
        """Register a layer's experts: gate/up (E, I, H), down (E, H, I). ``swiglu``:
        ``swiglu_oai``'s (alpha, limit); ``bias``: the experts' gate, up (E, I) and down (E, H)
        biases (copied by the library)."""
        if activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r} (choose from "
                             f"{', '.join(EXPERT_ACTIVATIONS)})")
        if (activation == "swiglu_oai") != (swiglu is not None):
            raise ValueError("swiglu (alpha, limit) goes with activation swiglu_oai, and only "
                             "with it")
        E, I_, H = gate.num_experts, gate.rows, gate.cols
        alpha, limit = swiglu or (0.0, 0.0)
        glu = GluDesc(alpha, limit)
        if bias is not None:
            want = ((E, I_), (E, I_), (E, H))
            bias = tuple(b.detach().to("cpu", torch.float32).contiguous() for b in bias)
            if tuple(tuple(b.shape) for b in bias) != want:
                raise ValueError(f"layer {layer}: expert biases of shapes "
                                 f"{[tuple(b.shape) for b in bias]}, want {list(want)}")
            glu.gate_bias, glu.up_bias, glu.down_bias = (b.data_ptr() for b in bias)
        err = ctypes.create_string_buffer(512)
        descs = [s.desc() for s in (gate, up, down)]
        rc = self._lib.ft_add_layer(
            self._handle,
            layer,
            E,
            H,
            I_,
            EXPERT_ACTIVATIONS[activation],
            ctypes.byref(glu),
            *(ctypes.byref(d) for d in descs),
            self._act_mode,
            err,
            512,
        )
        if rc != 0:
            raise ValueError(f"layer {layer}: {err.value.decode()}")
        kernels = []
        for p in range(3):
            isa, act = ctypes.c_int(), ctypes.c_int()
            self._lib.ft_layer_kernel(self._handle, layer, p, ctypes.byref(isa), ctypes.byref(act))
            kernels.append((ISAS[isa.value], ACT_KINDS[act.value]))
        info = LayerInfo(E, H, I_, (gate.fmt, up.fmt, down.fmt), tuple(kernels))
        self.layers[layer] = info
        self._stacks[layer] = (gate, up, down)
        return info

    def _check_moe(
        self, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, layer: int,
        out: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """submit's arguments as the workers read them: (x, ids, w, out)."""
        if layer not in self.layers:
            raise KeyError(f"layer {layer} has no experts on the CPU executor")
        x = as_host(hidden, torch.float32)
        ids = as_host(expert_ids, torch.int64)
        w = as_host(weights, torch.float32)
        T, H = x.shape
        if ids.dim() != 2 or ids.shape[1] == 0:
            raise ValueError(f"layer {layer}: expert ids {tuple(ids.shape)} must be (T, A), A > 0")
        if ids.shape != w.shape or ids.shape[0] != T or H != self.layers[layer].hidden:
            raise ValueError(
                f"layer {layer}: hidden {tuple(x.shape)}, ids {tuple(ids.shape)}, "
                f"weights {tuple(w.shape)} do not fit H={self.layers[layer].hidden}"
            )
        if not self._announced:
            self._announce(ids.shape[1])
        if out is None:
            out = torch.empty(T, H, dtype=torch.float32)
        elif out is not as_host(out, torch.float32) or out.shape != (T, H):
            raise ValueError(f"out must be a contiguous float32 CPU tensor of {(T, H)}")
        return x, ids, w, out

    def _take_slot(self) -> None:
        with self._lock:
            if self._in_flight >= MAX_IN_FLIGHT:
                raise RuntimeError(
                    f"more than {MAX_IN_FLIGHT} CPU jobs in flight; wait() on earlier futures "
                    "first"
                )
            self._in_flight += 1

    def _give_slot(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def _run_in_slot(self, fn: Any, *args: Any) -> int:
        """A library call that submits a job and waits for it, holding a slot meanwhile."""
        self._take_slot()
        try:
            return int(fn(self._handle, *args))
        finally:
            self._give_slot()

    def submit(
        self, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, layer: int,
        out: torch.Tensor | None = None,
    ) -> CpuMoeFuture:
        """Start ``sum_a weights[t, a] * expert_{ids[t, a]}(hidden[t])`` on the pool.

        hidden (T, H), expert_ids/weights (T, A); ids < 0 are skipped. Returns at once. The
        result goes to ``out`` if given (float32, contiguous, on the CPU, (T, H)).
        """
        x, ids, w, out = self._check_moe(hidden, expert_ids, weights, layer, out)
        if x.shape[0] == 0:
            fut = CpuMoeFuture(self, -1, out, ())
            fut._done = True
            return fut
        self._take_slot()
        ticket = self._lib.ft_submit(self._handle, layer, x.data_ptr(), ids.data_ptr(),
                                     w.data_ptr(), out.data_ptr(), x.shape[0], ids.shape[1],
                                     None)
        if ticket < 0:
            self._give_slot()
            raise ValueError(f"layer {layer}: expert ids must be < {self.layers[layer].experts}")
        return CpuMoeFuture(self, ticket, out, (x, ids, w))

    def prepare(self, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                layer: int, out: torch.Tensor) -> PreparedJob:
        """:meth:`submit`'s arguments checked once, for buffers a caller fills again before
        each submit (a decode graph's pinned host copies): :meth:`submit_prepared` queues
        them without the checks. They must already be what the workers read (float32 and
        int64, contiguous, on the CPU), so no copy stands between the caller and the job."""
        x, ids, w, out = self._check_moe(hidden, expert_ids, weights, layer, out)
        if x is not hidden or ids is not expert_ids or w is not weights:
            raise ValueError("prepared jobs read their buffers in place: float32 hidden and "
                             "weights, int64 ids, contiguous, on the CPU")
        args = (x.data_ptr(), ids.data_ptr(), w.data_ptr(), out.data_ptr(), x.shape[0],
                ids.shape[1])
        return PreparedJob(layer, args, out, (x, ids, w))

    def submit_prepared(self, job: PreparedJob, signal: int = 0) -> CpuMoeFuture:
        """:meth:`submit` of a job made by :meth:`prepare`; returns at once. ``signal``: the
        address of an int32 flag (pinned) the pool sets to 1 once the result is written, for a
        decode graph that waits on it (0: none)."""
        self._take_slot()
        ticket = self._lib.ft_submit(self._handle, job.layer, *job.args, signal or None)
        if ticket < 0:
            self._give_slot()
            raise ValueError(f"layer {job.layer}: expert ids must be < "
                             f"{self.layers[job.layer].experts}")
        return CpuMoeFuture(self, ticket, job.out, job.keep)

    def run_prepared(self, job: PreparedJob) -> float:
        """:meth:`submit_prepared` and the wait in one call into the library (the calling
        thread joins the job); returns the pool's seconds on it."""
        ns = ctypes.c_int64(0)
        if self._run_in_slot(self._lib.ft_run, job.layer, *job.args, ctypes.byref(ns)) < 0:
            raise ValueError(f"layer {job.layer}: expert ids must be < "
                             f"{self.layers[job.layer].experts}")
        return ns.value / 1e9

    @property
    def has_room(self) -> bool:
        """Whether one more job may be in flight now."""
        return self._in_flight < MAX_IN_FLIGHT

    def adopt(self, ticket: int, job: PreparedJob) -> CpuMoeFuture:
        """The future of prepared ``job``, which the library submitted under ``ticket`` (a
        layer call planned there: ``moe/layer_call.py``, after :attr:`has_room`)."""
        with self._lock:
            self._in_flight += 1
        return CpuMoeFuture(self, ticket, job.out, job.keep)

    def run(
        self, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, layer: int
    ) -> torch.Tensor:
        """submit + wait, in one call into the library: a decode step's synchronous path, where
        the Python of a future per layer shows in the engine thread's time."""
        if self._timing:
            return self.submit(hidden, expert_ids, weights, layer).wait()
        return self.run_measured(hidden, expert_ids, weights, layer, None)[0]

    def run_measured(
        self, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, layer: int,
        ns: ctypes.c_int64 | None = None,
    ) -> tuple[torch.Tensor, int]:
        """:meth:`run` that also gives the weight bytes read, and the pool's time on the job
        in ``ns`` (nanoseconds) when one is passed: what a benchmark of the decode path
        records."""
        x, ids, w, out = self._check_moe(hidden, expert_ids, weights, layer, None)
        if x.shape[0] == 0:
            return out, 0
        done = self._run_in_slot(self._lib.ft_run, layer, x.data_ptr(), ids.data_ptr(),
                                 w.data_ptr(), out.data_ptr(), x.shape[0], ids.shape[1],
                                 None if ns is None else ctypes.byref(ns))
        if done < 0:
            raise ValueError(f"layer {layer}: expert ids must be < {self.layers[layer].experts}")
        return out, int(done)

    @property
    def handle(self) -> int:
        """The library's executor, for jobs the library runs without this object (a CUDA
        graph's host nodes: ``cpu/host_node.py``)."""
        return self._handle

    @property
    def is_open(self) -> bool:
        return bool(getattr(self, "_handle", None))

    def decode_layer(self, layer: int, desc: ctypes.Structure, step: ctypes.Structure,
                     x: torch.Tensor) -> None:
        """One decoder layer of CPU float32 decode on x (B, H) in place
        (``models/native_decode.py`` builds the descriptors)."""
        if self._lib.ft_decode_layer(self._handle, ctypes.addressof(desc),
                                     ctypes.addressof(step), x.data_ptr()) != 0:
            raise RuntimeError(f"layer {layer}: the native decode layer refused its input (a "
                               "position past the rotary tables, or an expert id past the "
                               "layer's experts)")

    def wait_ticket(self, ticket: int) -> tuple[int, float, JobTiming | None]:
        ns = ctypes.c_int64(0)
        rec = (ctypes.c_int64 * self._lib.ft_timing_fields())() if self._timing else None
        nbytes = int(self._lib.ft_wait(self._handle, ticket, ctypes.byref(ns), rec))
        with self._lock:
            self._in_flight -= 1
        return nbytes, ns.value / 1e9, JobTiming.from_record(list(rec)) if rec else None

    def ready_line(self, top_k: int) -> str:
        infos = list(self.layers.values())
        fmts = sorted({f for i in infos for f in i.fmts})
        first = infos[0] if infos else None
        shape = f"H={first.hidden} I={first.intermediate} experts={first.experts}" if first else ""
        return (
            f"CPU MoE executor ready: threads={self.threads} ({describe_cores(self.cores)}) "
            f"isa={self.isa} fmt={','.join(fmts) or '-'} {shape} layers={len(infos)} "
            f"top_k={top_k}"
        )

    def _announce(self, top_k: int) -> None:
        self._announced = True
        log.info("%s", self.ready_line(top_k))

    def close(self) -> None:
        """Stop the workers (every future must have been waited) and give torch back the
        threads the pool's cores had capped it to (a later engine in this process plans its
        own)."""
        if self._handle:
            self._lib.ft_executor_free(self._handle)
            self._handle = None
            if self._torch_threads is not None and torch.get_num_threads() < self._torch_threads:
                torch.set_num_threads(self._torch_threads)
            self._torch_threads = None

    def __del__(self) -> None:
        if getattr(self, "_handle", None):
            self.close()
