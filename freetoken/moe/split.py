"""The hybrid split: of a layer's cache misses, how many to fetch over the link; the CPU
computes the rest. :class:`SplitPolicy` starts from the bandwidth profile's fraction and, when
online, corrects it from the times each call measures. The times are a property of the box
and of the layer's kind, not of the layer: hybrid layers of one kind share one
:class:`SplitCosts`, so each call's times refine the costs every such layer splits by, and an
idle side is probed once for all of them. A model can miss what a CPU share costs the step
(the engine thread's time in the pool's job, the link shared with look-ahead, memory both sides
read), so the kind's :class:`~freetoken.moe.wall_check.WallCheck` times the decode steps at a
few fetched shares now and then and holds the fastest until the next check.

Threads: the engine's main thread only (one policy per hybrid layer, one cost model per kind).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from freetoken.cpu.abi import FetchRule
from freetoken.moe.wall_check import WallCheck

PROBE_FIRST = 8  # one layer's calls after which a side left idle first gets work again
REMEASURE_EVERY = 256  # the longest such wait (it doubles while the side keeps losing)
# consecutive calls a CPU probe gives work: the first job after the CPU sat idle runs cold
# (the pool's workers asleep, their caches cold; on the H200 such jobs measured 200-450 us an
# expert against 45-57 warm), so it is not kept, and the next one is timed
PROBE_CALLS = 2


@dataclass
class SplitCosts:
    """The fitted costs of a call's two halves, shared by the ``layers`` hybrid layers of one
    kind, and when to probe a side left idle.

    Each observation updates smoothed costs: the CPU's time for a job of n experts as
    ``l_cpu + n * c_cpu`` (a fixed part: waking the pool and splitting the job, which a job of
    one expert pays as much as one of eight; fitted by least squares with forgetting over the
    job sizes seen), seconds per fetched expert (``c_pcie``), and the host time the CPU half
    adds to a call (``o``: handing over the hidden states and adding the result back). Their
    memory is ``smoothing`` per layer's call (each observation counts ``1 / layers`` of that),
    so the costs follow the box as fast as one layer's own would, from ``layers`` times the
    samples. A side idle for ``PROBE_FIRST`` calls of each layer is given work once (by the
    next call of any layer; the CPU by the next ``PROBE_CALLS``), then after twice as long
    each time the probe confirms it loses, up to ``REMEASURE_EVERY`` calls of each layer. A
    CPU job observed right after one without CPU work ran cold: its times are not kept; a
    probe's warm job rescales the CPU's costs to its own time.
    """

    layers: int = 1
    smoothing: float = 0.3
    check: WallCheck | None = None  # the steps' own verdict (None: the model's alone)
    # this step fetches every miss, whatever the split (a greedy sequence in its batch:
    # OffloadRuntime.fetch_every_miss); the wall check's arm it falls in starts again
    fetch_all: bool = False
    c_cpu: float | None = None  # seconds per expert on the CPU
    l_cpu: float = 0.0  # seconds per CPU job, whatever its size
    c_pcie: float | None = None  # seconds per fetched expert
    o: float = 0.0  # host seconds the CPU half adds to a call
    _idle_cpu: int = 0  # observations since the CPU last had an expert (any layer's)
    _idle_pcie: int = 0
    _wait_cpu: int = PROBE_FIRST  # idle calls of each layer before the CPU is probed again
    _wait_pcie: int = PROBE_FIRST
    _probe_left: int = 0  # further calls the CPU probe under way gives work
    _cpu_was_idle: bool = True  # the last observation had no CPU work: the next job is cold
    _fit: tuple[float, float, float, float, float] = field(
        default=(0.0, 0.0, 0.0, 0.0, 0.0), repr=False)  # the CPU fit's decayed sums

    @property
    def known(self) -> bool:
        return self.c_cpu is not None and self.c_pcie is not None

    def best(self, m: int) -> int:
        """The fetch count of ``m`` misses with the shortest call, by the fitted costs (known):
        ``max(n * c_pcie, l_cpu + (m - n) * c_cpu) + o`` while the CPU has a share, else
        ``m * c_pcie``."""
        assert self.c_cpu is not None and self.c_pcie is not None
        c_cpu, c_pcie, o, l_cpu = self.c_cpu, self.c_pcie, self.o, self.l_cpu
        return min(range(m + 1), key=lambda n: max(n * c_pcie, l_cpu + (m - n) * c_cpu)
                   + o if n < m else n * c_pcie)

    def probe_due(self, side: str) -> bool:
        """Whether ``side`` ("cpu" or "pcie"), idle, is due a probe (or was never timed)."""
        if side == "cpu":
            return (self.c_cpu is None or self._probe_left > 0
                    or self._idle_cpu >= self._wait_cpu * self.layers)
        return self.c_pcie is None or self._idle_pcie >= self._wait_pcie * self.layers

    def probed(self, side: str) -> None:
        """A call probes ``side``: the idle count starts again, so the calls of other layers
        before its observation do not probe it too."""
        if side == "cpu":
            self._idle_cpu = 0
            self._probe_left = PROBE_CALLS - 1 if self._probe_left == 0 else self._probe_left - 1
        else:
            self._idle_pcie = 0

    def observe(self, n_cpu: int, t_cpu: float, n_fetch: int, t_pcie: float,
                overhead: float, pcie_warm: bool, probing: str) -> None:
        """One call's halves: ``n_cpu`` experts in ``t_cpu`` on the CPU, ``n_fetch`` fetched in
        ``t_pcie``, the host's ``overhead``. ``pcie_warm``: whether the fetch time is kept (a
        layer's first fetch is a warm-up); ``probing``: the side the call probed."""
        self._idle_cpu = 0 if n_cpu else self._idle_cpu + 1
        self._idle_pcie = 0 if n_fetch else self._idle_pcie + 1
        cold, self._cpu_was_idle = self._cpu_was_idle, n_cpu == 0
        if n_cpu > 0 and t_cpu > 0 and not cold:
            if probing == "cpu" and self.c_cpu is not None:
                self._rescale_cpu(n_cpu, t_cpu, overhead)
            self._fit_cpu(n_cpu, t_cpu)
            self.o = self._smooth(self.o, overhead)
        if n_fetch > 0 and t_pcie > 0 and pcie_warm:
            self.c_pcie = self._smooth(self.c_pcie, t_pcie / n_fetch)
        m = n_cpu + n_fetch
        if not self.known or m == 0:
            return
        best = self.best(m)
        # a probed side that still loses waits twice as long for its next probe; a side
        # a split itself uses is probed soon once it goes idle
        if n_cpu and not cold:  # a cold job judges nothing
            lost = probing == "cpu" and best == m
            self._wait_cpu = min(2 * self._wait_cpu, REMEASURE_EVERY) if lost else PROBE_FIRST
        if n_fetch:
            lost = probing == "pcie" and best == 0
            self._wait_pcie = (min(2 * self._wait_pcie, REMEASURE_EVERY) if lost
                               else PROBE_FIRST)

    def _rescale_cpu(self, n: int, t: float, overhead: float) -> None:
        """A probe's warm job of ``n`` experts took ``t``: the CPU's past times are scaled to
        its level (both fitted costs by ``t`` over their prediction) and its host overhead
        taken as it is. Probes are rare, so a smoothed update would leave costs measured
        in another state of the box (a busy CPU, cold jobs) deciding for hundreds of steps;
        if the probe flattered the CPU, the calls that then use it correct the costs."""
        assert self.c_cpu is not None
        k = t / (self.l_cpu + n * self.c_cpu)
        s0, s1, s2, t0, t1 = self._fit
        self._fit = s0, s1, s2, k * t0, k * t1
        self.c_cpu, self.l_cpu, self.o = k * self.c_cpu, k * self.l_cpu, overhead

    def _fit_cpu(self, n: int, t: float) -> None:
        """One CPU job of ``n`` experts that took ``t``: ``l_cpu`` and ``c_cpu`` refitted. The
        sums decay by ``1 - smoothing / layers`` per job; while the jobs seen are all of one
        size the fixed part keeps its last estimate and the per-expert cost takes the rest."""
        keep = 1 - self.smoothing / self.layers
        s0, s1, s2, t0, t1 = (keep * v for v in self._fit)
        self._fit = s0, s1, s2, t0, t1 = s0 + 1, s1 + n, s2 + n * n, t0 + t, t1 + n * t
        det = s0 * s2 - s1 * s1
        if det > 0.05 * s0 * s0:  # job sizes vary enough (n's variance > 0.05)
            c = (s0 * t1 - s1 * t0) / det
            lat = (t0 - c * s1) / s0
            if c > 0 and lat >= 0:
                self.c_cpu, self.l_cpu = c, lat
                return
        self.l_cpu = min(self.l_cpu, t0 / s0)
        self.c_cpu = max((t0 - self.l_cpu * s0) / s1, 1e-9)

    def _smooth(self, old: float | None, new: float) -> float:
        a = self.smoothing / self.layers
        return new if old is None else (1 - a) * old + a * new


@dataclass
class SplitPolicy:
    """How many of a layer's misses to fetch; the rest run on the CPU.

    ``fraction``: share of misses fetched (None until a profile row or measurements give one);
    ``max_fetch``: cap on fetched experts per call (None: no cap). With ``online``, each call's
    times go to ``costs`` (the kind's, shared with the other hybrid layers of that kind; a
    policy made alone has its own) and ``fraction`` moves toward the best split of the call's
    m misses (:meth:`SplitCosts.best`) by at most ``step`` per observation, so a wrong profile
    row, or a CPU half that costs more than it saves, is corrected toward the better split
    (all fetched, as offload, when the CPU does not pay). The link's first observation in
    each layer is a warm-up (first-use allocations) and is not kept; the CPU's cold jobs are
    the kind's to skip (:class:`SplitCosts`). A side without
    an estimate, or idle long enough (:meth:`SplitCosts.probe_due`), is given work so that it
    is measured: the link one expert, the CPU the share ``probe_fraction`` gives it (the
    profile row's), since a job of one expert measures mostly the fixed part.
    """

    fraction: float | None = None
    max_fetch: int | None = 1
    online: bool = True
    step: float = 0.5
    probe_fraction: float = 0.5  # fetched share of a CPU probe's misses
    costs: SplitCosts = field(default_factory=SplitCosts)
    probing: str = ""  # "cpu" or "pcie": n_fetch gave that idle side work to time it
    # this call runs in a decode graph made for steps that fetch every miss (it has no CPU
    # share to collect): set around the call by HybridExperts._plan_fetching
    fetching: bool = False
    _seen_pcie: int = 0

    @property
    def held(self) -> float | None:
        """The fetched share the kind's wall check has calls use now (all-fetch's 1.0, the cpu
        arm's 0.0 or the profile's; 1.0 in a step that fetches every miss), or None: the
        policy's own ``fraction``."""
        if self.costs.fetch_all or self.fetching:
            return 1.0
        check = self.costs.check
        return check.fraction if self.online and check is not None else None

    @property
    def share(self) -> float | None:
        """The fetched share calls use now: the wall check's held one, else ``fraction``."""
        held = self.held
        return self.fraction if held is None else held

    @property
    def all_fetch(self) -> bool:
        """Whether calls fetch every miss now (the wall check's all-fetch arm, or the CPU
        benched)."""
        return self.held == 1.0

    @property
    def all_cpu(self) -> bool:
        """Whether calls put every routed pair on the CPU now, hits too (the wall check's cpu
        arm, timed or held)."""
        return self.held == 0.0

    def planned(self, misses: int) -> int:
        """The split's fetch count for ``misses`` before any probe (a held share is not
        capped)."""
        held = self.held
        return self._own(misses) if held is None else round(held * misses)

    def _own(self, misses: int) -> int:
        n = misses if self.fraction is None else round(self.fraction * misses)
        return n if self.max_fetch is None else min(n, self.max_fetch)

    def start(self, rows: int) -> None:
        """A call of ``rows`` token rows starts: the kind's wall check counts it (before the
        call reads :attr:`held`, which the check may change)."""
        check = self.costs.check
        if self.online and check is not None:
            if self.costs.fetch_all:  # not the arm's call: the arm starts again after it
                check.skip()
            else:
                check.tick(rows)
                # an arm other than all-fetch began in a step made to fetch every miss (none
                # should): it starts again after it
                if self.fetching and check.phase not in ("wait", "fetch"):
                    check.skip()

    def fetches_next(self, calls: int) -> bool:
        """Whether the kind's next ``calls`` calls (a decode step's, one per layer) all fetch
        every miss with no probe: a greedy step's, all-fetch held by the wall check with no
        arm due among them or its all-fetch arm's, or a fixed split that fetches all. Such a
        step can run in decode graphs without a CPU share (``engine/graph.py``)."""
        if self.costs.fetch_all:
            return True
        check = self.costs.check
        if self.online:
            return check is not None and check.holds_fetch(calls)
        return self.fraction is not None and self.fraction >= 1.0 and self.max_fetch is None

    def n_fetch(self, misses: int, rows: int = 1) -> int:
        """Misses to fetch of a call's ``misses`` (``rows`` token rows): :meth:`start` and
        :meth:`count`."""
        self.start(rows)
        return self.count(misses)

    def count(self, misses: int) -> int:
        """Misses to fetch of the call :meth:`start` began."""
        self.probing = ""
        held = self.held
        if held is not None:  # the wall check's share: both sides are timed by it
            return round(held * misses)
        n = self._own(misses)
        if self.online and misses >= 2:  # keep both sides measured, so f can move back
            costs = self.costs
            if n == 0 and costs.probe_due("pcie"):
                n, self.probing = 1, "pcie"
            if n == misses and costs.probe_due("cpu"):
                k = min(misses, max(1, round((1 - self.probe_fraction) * misses)))
                n, self.probing = misses - k, "cpu"
            if self.probing:
                costs.probed(self.probing)
        return n

    def rule(self, into: FetchRule) -> None:
        """:meth:`count`'s decision for a call :meth:`start` began, written ``into`` the
        library's rule (``csrc/layer_call.cpp`` counts the misses once it has routed; the
        probe it made goes to :meth:`probed`)."""
        held = self.held
        into.held = held is not None
        if held is not None:
            into.share = held
            return
        into.share = -1.0 if self.fraction is None else self.fraction
        into.max_fetch = -1 if self.max_fetch is None else self.max_fetch
        into.online = self.online
        into.probe_share = self.probe_fraction
        costs = self.costs
        into.pcie_due = self.online and costs.probe_due("pcie")
        into.cpu_due = self.online and costs.probe_due("cpu")

    def probed(self, probing: str) -> None:
        """The probe the library's count made for the call (as :meth:`count` records its
        own)."""
        self.probing = probing
        if probing:
            self.costs.probed(probing)

    def observe(self, n_cpu: int, t_cpu: float, n_fetch: int, t_pcie: float,
                overhead: float = 0.0) -> None:
        if not self.online:
            return
        if n_fetch > 0 and t_pcie > 0:
            self._seen_pcie += 1
        costs = self.costs
        costs.observe(n_cpu, t_cpu, n_fetch, t_pcie, overhead,
                      self._seen_pcie > 1, self.probing)
        m = n_cpu + n_fetch
        if not costs.known or m == 0:
            return
        target = costs.best(m) / m
        if self.fraction is None:
            self.fraction, self.max_fetch = target, None
            return
        delta = max(-self.step, min(self.step, target - self.fraction))
        self.fraction = min(1.0, max(0.0, self.fraction + delta))
