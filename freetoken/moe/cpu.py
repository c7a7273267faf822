"""CPU strategy: every expert stays in host memory in its checkpoint format and the CPU MoE
executor computes the routed ones; the result goes back to the model's device.

The loader hands expert tensors over undequantised through :meth:`CpuExperts.load_expert_tensor`
(stacked ``E x out x in``, fused ``gate_up_proj``, or one expert at a time). All layers share the
one pool of pinned workers the runner made and :meth:`CpuExperts.attach` hands over.

On a GPU, decode CUDA graphs break at each layer's experts (``moe/pieces.py``): a host step
copies the routed ids, weights and hidden states to pinned memory (one sync), runs the pool's
job on them, which writes into pinned memory, and queues the copy of that result into the
buffer the next piece adds. With ``FREETOKEN_CPU_HOST_NODE=on`` the graph holds each layer's
job instead (:meth:`~freetoken.moe.pieces.PiecewiseCapture.node`: the copies, the job as a
host node run by the CUDA driver's thread, ``cpu/host_node.py``), a step being one replay with
no Python between layers; it measured half as fast on the H200 (a316a05's sitting) and 6 %
faster on an H100 (48 layers, e2f4c22), so it is not the default until both agree. With
``flag`` the graph holds the copies and a go and a done flag per job, and the engine thread
that launched the replay serves the jobs (``cpu/graph_flags.py``): no driver thread either.
Prefill runs eagerly: ``x`` to the host, the pool's job, the result back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

import torch

from freetoken.cpu import executor as cx
from freetoken.cpu.graph_flags import graph_jobs
from freetoken.cpu.jobs import JobLog
from freetoken.errors import ConfigError
from freetoken.moe.host_banks import BankBuilder
from freetoken.moe.host_job import HostJobs
from freetoken.moe.host_steps import HostCopies
from freetoken.moe.pieces import Recorder
from freetoken.moe.strategy import Experts, ExpertShape, LayerPlan, Needs, Shared
from freetoken.quant import QuantTensor, get_format


@dataclass
class HostStepTimes:
    """A layer's host steps between graph pieces so far: how many, their wall seconds on the
    engine thread, and the pool's seconds on their jobs (submit to last item)."""

    calls: int = 0
    step_s: float = 0.0
    job_s: float = 0.0


def host_step_totals(layers: list[CpuExperts]) -> dict[str, float]:
    """The cpu layers' host steps so far, summed (:class:`HostStepTimes`'s fields): what
    ``/v1/stats`` shows as ``cpu_pool`` and the decode log line breaks a token into."""
    return {f.name: sum(getattr(m.host_times, f.name) for m in layers)
            for f in fields(HostStepTimes)}


class CpuExperts(Experts):
    """One MoE layer's experts in host memory; forward runs them on the CPU executor."""

    NEEDS = Needs(cpu_pool=True, host_banks=True)

    def __init__(self, shape: ExpertShape) -> None:
        super().__init__()
        if (why := shape.native_missing()) is not None:
            raise ConfigError(f"--moe-strategy cpu cannot run layer {shape.layer}: {why}")
        reason = cx.available()
        if reason is not None:
            raise ConfigError(f"--moe-strategy cpu needs the CPU MoE library, but {reason}")
        self.shape = shape
        self.make_bias()
        self.builder = BankBuilder(shape.layer, shape.num_experts, shape.hidden,
                                   shape.intermediate)
        self.device = torch.empty(0).device  # the device the model is being built on
        self._pool: cx.CpuMoeExecutor | None = None  # given by attach
        self._recorder: Recorder | None = None  # given by attach on a GPU
        self.registered = False  # the banks are on the pool (from attach)
        self.host_jobs = HostJobs(shape.layer)  # the pool's jobs between graph pieces
        self.host_times = HostStepTimes()
        self.jobs = JobLog()  # the host steps' timed jobs, with the pool's timing on

    def load_expert_tensor(self, proj: str, qt: QuantTensor, expert: int | None = None) -> bool:
        """Keep one checkpoint tensor (see :meth:`BankBuilder.add`); f32 and f16 weights are
        kept as bf16, which the kernels read."""
        if qt.fmt in ("f32", "f16"):
            qt = get_format("bf16").quantize(get_format(qt.fmt).dequantize(qt))
        return self.builder.add(proj, qt, expert)

    def missing_expert_tensors(self) -> list[str]:
        """What the checkpoint has not provided yet, e.g. ``['down_proj', 'up_proj[3]']``."""
        return [] if self.registered else self.builder.missing()

    def attach(self, plan: LayerPlan, shared: Shared) -> None:
        """Run on the model's CPU pool, the banks handed to it now (with the model's load, so
        the first request does not pay the copy: seconds for a large model)."""
        if shared.pool is None:
            raise RuntimeError(f"layer {self.shape.layer}: cpu experts need the CPU pool, "
                               "and none was made")
        self._pool, self._recorder = shared.pool, shared.recorder
        if not self.registered:
            self.register()

    def recorder(self) -> Recorder | None:
        return self._recorder

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:  # x (T, H), ids/weights (T, A) -> (T, H)
        ex = self._pool if self.registered else self.register()
        assert ex is not None
        capture = self._recorder.capture if self._recorder is not None else None
        if capture is not None:  # decode graphs: the pool's job in the piece, or between two
            if capture.copier is not None and not isinstance(graph_jobs(), str):
                return capture.node(ex, self.shape.layer, x, topk_ids, topk_weights)
            return capture.host(self._host_step, x, topk_ids, topk_weights)
        out = ex.run(x, topk_ids, topk_weights, self.shape.layer)
        return out.to(device=x.device, dtype=x.dtype)

    def _host_step(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                   host: HostCopies) -> torch.Tensor:
        """The step between graph pieces: the pool's job on the inputs' host copies (``x``,
        ``ids`` and ``w`` are the device's, not read); its result is ``host.cpu_out``."""
        pool = self._pool
        assert pool is not None
        t0 = time.perf_counter()
        job = self.host_jobs.get(pool, host)
        times = self.host_times
        if not pool.timing:  # submit, join, wait: one call
            job_s = job.run()
        else:  # the job and its experts logged item by item
            future = job.submit(all_pairs=True)
            future.wait()
            self.jobs.add(future, int(host.ids.unique().numel()))
            job_s = future.seconds
        times.calls += 1
        times.step_s += time.perf_counter() - t0
        times.job_s += job_s
        return host.cpu_out

    def register(self) -> cx.CpuMoeExecutor:
        """Copy the banks to huge-page host memory and hand them to the executor."""
        missing = self.missing_expert_tensors()
        if missing:
            raise ConfigError(f"layer {self.shape.layer}: the cpu strategy was not given expert "
                              f"weights {', '.join(missing[:5])} (the checkpoint lacks them, or "
                              "the loader did not hand them over through load_expert_tensor)")
        stacks = []
        for proj in cx.PROJECTIONS:
            b = self.builder
            src = b.stacked.get(proj) or [t for t in b.per_expert[proj] if t is not None]
            stacks.append(cx.ExpertStack.from_quant(src, copy=True))
        ex = self._pool
        if ex is None:
            raise RuntimeError(f"layer {self.shape.layer}: cpu experts used before attach() "
                               "gave them the CPU pool")
        ex.add_layer(self.shape.layer, *stacks, **self.native_glu())
        self.builder.stacked.clear()
        self.builder.per_expert.clear()
        self.registered = True
        return ex

