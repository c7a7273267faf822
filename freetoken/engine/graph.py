"""CUDA graphs of decode steps: one graph per batch size up to ``--cuda-graph-max-bs``.

A decode step at batch b runs the graph captured for the smallest size >= b. Every input lives
in a static buffer sized for that graph: keys are padded to the runner's full context, padded
batch rows write their KV to a scratch page and attend to it alone, and their logits are
dropped. Prefill and mixed steps, and batches above the largest size, run eagerly.

Layers whose experts the host must plan (offload, hybrid: which slot, fetch or CPU) split the
capture into pieces. Each piece ends where such a layer's experts are called (their inputs, the
normed hidden states and the routed ids and weights, stay in the graph's memory) and the host
runs its part between replays:
- a plan (:meth:`PiecewiseCapture.host`): its inputs come to pinned host buffers with one
  sync; it makes the copies and the layer's slot table; the next piece begins with the
  experts' device compute, which reads the slots through that table, plus a static buffer the
  plan may fill;
- then, where the plan left work running on the host (hybrid's CPU share), a second step
  (:meth:`PiecewiseCapture.after`) with no sync: it runs while the device computes its share,
  and its result (which the CPU pool wrote straight into pinned memory) lands in a static
  buffer the piece after it adds;
- or, for calls with too many pairs to gather, the whole experts call
  (:meth:`PiecewiseCapture.split`), the next piece reading its output from a static buffer.
The dense part of every layer stays captured. With ``FREETOKEN_CPU_HOST_NODE=on`` experts the
CPU pool computes without a plan (cpu) stay in the piece too, their job a host node
(:meth:`PiecewiseCapture.node`); with ``flag`` their job stays in the piece as a go flag the
graph writes and a done flag it waits for, which the engine thread serves after launching
the piece (``cpu/graph_flags.py``).

Where layers may leave host work running (hybrid), each size is captured twice: as above, and
for steps in which every layer fetches every miss (hybrid's split held at all-fetch, a greedy
step), whose hybrid layers plan as offload's do, from the routed ids alone and with no late
step. A step runs the second set when every such layer says its next call fetches all
(:meth:`~freetoken.moe.offload.OffloadExperts.fetches_next_step`); all-fetch hybrid then costs
what offload does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from freetoken import env
from freetoken.cpu.graph_flags import FlagJobs, stream_memops
from freetoken.cpu.host_node import HostNodes
from freetoken.engine.graph_launch import launchers
from freetoken.kvcache.paged import PagedKV
from freetoken.layers.context import ForwardContext, Segment
from freetoken.moe.host_steps import Break, HostStep, LateStep
from freetoken.moe.pieces import PiecewiseCapture
from freetoken.moe.strategy import Experts

log = logging.getLogger(__name__)


class Launches:
    """The pieces of one replay, launched in order (``launch``: one call per piece,
    ``engine/graph_launch.py``): by the runner, or by a host step whose plan has queued its own
    device work (FREETOKEN_HOST_STEPS=early)."""

    def __init__(self, launch: list[Callable[[], None]]) -> None:
        self.launch, self.next = launch, 0

    def __call__(self) -> None:
        self.launch[self.next]()
        self.next += 1


def host_steps_flagged() -> bool:
    """Whether decode graphs hold host plans inside their pieces, on flags
    (FREETOKEN_HOST_STEPS=flags and a driver with stream memory operations; without them the
    graph breaks at each plan: :class:`DecodeGraphs` warned once)."""
    return env.host_steps() == "flags" and not isinstance(stream_memops(), str)


def late_steps_flagged() -> bool:
    """Whether decode graphs whose plans run between pieces wait for the CPU's results on
    flags inside the next piece (FREETOKEN_LATE_STEPS=flags and a driver with stream memory
    operations), not in late steps between two more pieces."""
    return env.late_steps() == "flags" and not isinstance(stream_memops(), str)


def graph_sizes(max_bs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8, 16, 24, 32, 48, 64) if s < max_bs]
    return sizes + [max_bs]


@dataclass
class _Pieces:
    """One capture of a step in pieces: the pieces, the host's work between them, the CPU
    pool's jobs held as host nodes, the logits buffer."""

    pieces: list[torch.cuda.CUDAGraph]
    breaks: list[Break | HostStep | LateStep]
    nodes: HostNodes | None
    out: torch.Tensor
    launch: list[Callable[[], None]]  # one per piece (engine/graph_launch.py)


class _Graph:
    """Static inputs, the captured graph and its output for one batch size."""

    def __init__(self, bs: int, keys: int, windows: tuple[int, ...], kv: PagedKV,
                 device: torch.device) -> None:
        long = dict(dtype=torch.long, device=device)
        self.bs = bs
        self.ids = torch.zeros(bs, **long)
        self.positions = torch.zeros(bs, **long)
        self.slots = torch.zeros(bs, **long)
        self.k_slots = torch.zeros(bs, keys, **long)
        self.masks = {w: torch.zeros(bs, 1, 1, keys, dtype=torch.bool, device=device)
                      for w in windows}
        self.ctx = ForwardContext(
            positions=self.positions, slots=self.slots, kv=kv,
            q_index=torch.arange(bs, device=device)[:, None],
            q_valid=torch.ones(bs, 1, dtype=torch.bool, device=device),
            k_slots=self.k_slots, logit_rows=None, single=False,
            masks=self.masks, decode=True)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None
        self.split: _Pieces | None = None  # the step in pieces around host-planned experts
        self.fetching: _Pieces | None = None  # the same for steps that fetch every miss


class DecodeGraphs:
    """Engine-thread only. Owns one scratch KV page for padded rows."""

    def __init__(self, model: torch.nn.Module, kv: PagedKV, max_len: int,
                 windows: tuple[int, ...], max_bs: int, device: torch.device) -> None:
        self.model, self.kv, self.keys, self.windows = model, kv, max_len, windows
        self.scratch = kv.allocate(1)[0] * kv.page_size
        self.graphs: dict[int, _Graph] = {}
        self.recorders = list({id(r): r for m in model.modules() if isinstance(m, Experts)
                               and (r := m.recorder()) is not None}.values())
        # layers that may leave host work running after their plan (hybrid): the steps in
        # which all of them fetch every miss run graphs made for that
        self.late = [m for m in model.modules()
                     if isinstance(m, Experts) and getattr(m, "FINISHES_LATE", False)]
        self.fetching_steps = 0  # steps run in the graphs for steps that fetch every miss
        # a host step launches the next piece once its plan's device work is queued
        self.early = env.host_steps() == "early"
        pool = torch.cuda.graph_pool_handle()
        memops = stream_memops()  # probed (a graph of its own) before any capture: cached
        if isinstance(memops, str) and self.recorders:
            log.warning("decode graphs cannot hold flags (%s): the CPU pool's jobs and host "
                        "plans run between graph pieces, a slower step", memops)
        for bs in sorted(graph_sizes(max_bs), reverse=True):  # largest first
            g = _Graph(bs, max_len, windows, kv, device)
            self._pad(g, 0)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.inference_mode():
                for _ in range(2):  # warm up: lazy inits must not land in the graph
                    model(g.ids, g.ctx)
            if self.recorders:
                g.split = self._capture_pieces(g, pool, stream, fetching=False)
                if self.late:
                    g.fetching = self._capture_pieces(g, pool, stream, fetching=True)
            else:
                torch.cuda.current_stream().wait_stream(stream)
                g.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g.graph, pool=pool), torch.inference_mode():
                    g.out = model(g.ids, g.ctx)
            self.graphs[bs] = g
        self.sizes = sorted(self.graphs)
        split = next(iter(self.graphs.values())).split
        pieces = 1 if split is None else len(split.pieces)
        flagged = split is not None and isinstance(split.nodes, FlagJobs) and split.nodes.steps
        log.info("CUDA graphs captured for decode batch sizes %s (keys padded to %d%s%s%s)",
                 self.sizes, max_len, f"; {pieces} pieces around host-planned experts"
                 if pieces > 1 else "", ("; the CPU's results awaited on flags" if pieces > 1
                                         else "; host plans inside the graph, on flags")
                 if flagged else "", "; again for steps that fetch every miss"
                 if self.late else "")

    def _capture_pieces(self, g: _Graph, pool: tuple[int, int], stream: torch.cuda.Stream,
                        fetching: bool) -> _Pieces:
        rows = next((r.rows for r in self.recorders if r.rows is not None), None)
        cap = PiecewiseCapture(pool, rows, fetching, flagged=host_steps_flagged(),
                               late_flags=late_steps_flagged())
        for rt in self.recorders:
            rt.capture = cap
        torch.cuda.synchronize()
        try:
            with torch.cuda.stream(stream), torch.inference_mode():
                cap.begin()
                out = self.model(g.ids, g.ctx)
                cap.end()
        finally:
            for rt in self.recorders:
                rt.capture = None
        torch.cuda.current_stream().wait_stream(stream)
        return _Pieces(cap.pieces, cap.breaks, cap.nodes, out, launchers(cap.pieces))

    def fits(self, segments: list[Segment]) -> bool:
        return len(segments) <= self.sizes[-1] and all(s.count == 1 for s in segments)

    def _pad(self, g: _Graph, n: int) -> None:
        """Rows n.. of ``g`` write to the scratch slot and see only it."""
        g.slots[n:] = self.scratch
        g.k_slots[n:] = self.scratch
        g.positions[n:] = 0
        for m in g.masks.values():
            m[n:] = False
            m[n:, ..., 0] = True

    @torch.inference_mode()
    def run(self, tokens: list[list[int]], segments: list[Segment]) -> torch.Tensor:
        n = len(segments)
        g = self.graphs[next(s for s in self.sizes if s >= n)]
        cpu = ForwardContext.build(self.kv, segments, torch.device("cpu"), self.windows)
        S = cpu.k_slots.shape[1]
        g.ids[:n].copy_(torch.tensor([t[0] for t in tokens]), non_blocking=True)
        g.positions[:n].copy_(cpu.positions, non_blocking=True)
        g.slots[:n].copy_(cpu.slots, non_blocking=True)
        g.k_slots[:n, :S].copy_(cpu.k_slots, non_blocking=True)
        g.k_slots[:n, S:] = self.scratch
        for w, m in g.masks.items():
            m[:n, ..., S:] = False
            m[:n, ..., :S].copy_(cpu.masks[w], non_blocking=True)
        self._pad(g, n)
        if g.split is None:
            assert g.graph is not None and g.out is not None
            g.graph.replay()
            return g.out[:n]
        p = g.split
        if g.fetching is not None and all(m.fetches_next_step() for m in self.late):
            p = g.fetching
            self.fetching_steps += 1
        if p.nodes is not None:  # the CPU's jobs inside the graph: the rows they compute
            p.nodes.check()
            p.nodes.set_rows(n)
        go = Launches(p.launch)
        early = self.early
        try:
            for i in range(len(p.pieces)):
                if go.next == i:  # not launched by the host step before it
                    go()
                if p.nodes is not None:  # the piece's jobs served on their flags
                    p.nodes.serve(i)
                if i < len(p.breaks):
                    step = p.breaks[i]
                    if early and isinstance(step, HostStep) and i + 1 < len(p.pieces):
                        step.run(n, go)
                    else:
                        step.run(n)
        except BaseException:
            if p.nodes is not None:  # a replay waiting for a job is let go, and ends before
                p.nodes.release()  # the next step zeroes the flags
                p.nodes.wait()
            raise
        if p.nodes is not None:
            p.nodes.wait()
        return p.out[:n]
