"""The wall check: hybrid's split judged by the decode steps it makes, not by the cost model
that proposes it. Now and then a :class:`WallCheck` times a kind's layer calls at a few fetched
shares (all, the online model's, none, the profile's) and holds the fastest until the next
check; :class:`~freetoken.moe.split.SplitPolicy` follows what it holds.

Threads: the engine's main thread only (one check per hybrid layer kind).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

# the wall check, in decode calls of each layer (tokens at batch 1): the first after
# CHECK_FIRST, each arm CHECK_SETTLE untimed then CHECK_ARM timed, the wait doubling up to
# CHECK_LONGEST; another arm must be CHECK_MARGIN faster than the held one to replace it, and
# an arm CHECK_DROP slower than the chosen one sits the next check out, twice as many each
# time it loses again, up to CHECK_SITOUT. The untimed start keeps the switch's own cost out
# of the arm (the pool waking after an all-fetch arm, the look-ahead's slots picked for the
# other arm)
CHECK_FIRST = 16
CHECK_SETTLE = 2
CHECK_ARM = 8
CHECK_LONGEST = 1024
CHECK_MARGIN = 0.03
CHECK_DROP = 0.2
CHECK_SITOUT = 8
# an arm already CHECK_EARLY slower than the fastest arm this check has timed, CHECK_STOP
# calls into its timed ones (of each layer), stops there: it would lose (on the H100 the fp4
# files' losing arms were 23-64 % slower than all-fetch, the qwen3 file's all-fetch 41-49 %
# slower than the split, and the search cost a 64-token run 6-10 %)
CHECK_EARLY = 0.15
CHECK_STOP = CHECK_ARM // 4
DECODE_ROWS = 16  # a call of more token rows (prefill) is not timed: it restarts an arm
IDLE_GAP = 10  # a gap this many times an arm's mean call: the engine sat idle, the arm restarts


@dataclass(frozen=True)
class Verdict:
    """One wall check: seconds a layer call under each arm it timed, and the arm chosen."""

    seconds: dict[str, float]
    choice: str


@dataclass
class WallCheck:
    """The split judged by the steps it makes. Its arms are fetched shares: ``fetch`` (every miss
    fetched), ``split`` (the online model's own), ``cpu`` (none: in a gathered call every routed
    pair on the CPU, hits too, as the cpu strategy runs a layer) and, where the bandwidth
    profile gave the kind a split (:meth:`use_profile`), ``profile`` (that share, fixed; held
    from the start). After ``wait`` decode calls of each of the kind's ``layers``, each arm runs
    CHECK_SETTLE + CHECK_ARM calls, the last CHECK_ARM timed by the wall between calls (a call's
    whole cycle: the GPU, the link, the CPU, the host), the held arm first; an arm CHECK_EARLY
    slower than the fastest one so far after CHECK_STOP of them stops there. An arm CHECK_MARGIN
    faster than the held one is held instead: the calls until the next check use its share
    (all-fetch benches the CPU: no share, no probes), while the model keeps learning from the
    split's calls; either way the wait doubles, and an arm CHECK_DROP slower than the chosen
    one sits the next check out, twice as many each time it loses again (the model's split
    never does: on a box where an arm never pays, it costs one check in CHECK_SITOUT + 1 once
    the waits are long). The model's costs are measured per half (the pool's time on a job,
    the copies'), which can miss what the step pays (on an H100 box its early split took 740
    us a layer call where the profile's took 440); the wall does not. What would time
    something else is left out: a prompt's call or an idle gap (no request: IDLE_GAP times
    the arm's mean call) restarts the arm it falls in, and a change of batch rows the whole
    check, so that every arm times the same batch. ``clock`` is for tests."""

    name: str = ""
    layers: int = 1
    clock: Callable[[], float] = time.perf_counter
    profile: float | None = None  # the profile's fetched share (an arm when 0 < share < 1)
    choice: str = "split"  # the arm the calls between checks follow
    phase: str = "wait"  # "wait", then each arm in turn (``_arms``)
    _wait: int = CHECK_FIRST
    _calls: int = 0  # decode calls counted in the phase so far
    _t0: float = 0.0  # when the arm's first call started
    _restart: bool = False  # the arm starts again at the next decode call (a prompt fell in it)
    _settling: bool = False  # the arm's untimed start (CHECK_SETTLE calls) is under way
    _last: float = 0.0  # when the last call started
    _rows: int = 0  # the batch rows the check's arms time
    _arms: tuple[str, ...] = ()  # this check's arms
    _sitout: dict[str, int] = field(default_factory=dict)  # checks an arm still sits out
    _lost: dict[str, int] = field(default_factory=dict)  # an arm's losses in a row
    _seconds: dict[str, float] = field(default_factory=dict)  # this check's arms so far
    verdicts: list[Verdict] = field(default_factory=list)  # the last 16 checks
    arm_calls: int = 0  # decode calls made under an arm (not the held choice), all checks

    def use_profile(self, share: float | None) -> None:
        """The profile's fetched share: an arm, and held until a check finds a faster one
        (a share of 0 or 1 is the cpu or fetch arm already)."""
        if share is not None and 0 < share < 1:
            self.profile, self.choice = share, "profile"

    @property
    def arms(self) -> tuple[str, ...]:
        """Every arm a check may time (one that lost by CHECK_DROP sits the next one out)."""
        return ("fetch", "split", "cpu") + (("profile",) if self.profile is not None else ())

    @property
    def benched(self) -> bool:
        """Whether all-fetch is held: the CPU gets no experts until the next check."""
        return self.choice == "fetch"

    @property
    def fraction(self) -> float | None:
        """The fetched share this call uses: 1.0 for all-fetch, 0.0 for the cpu arm, the
        profile's, or None for the model's own (its arm, or held)."""
        arm = self.choice if self.phase == "wait" else self.phase
        if arm == "split":
            return None
        return 1.0 if arm == "fetch" else 0.0 if arm == "cpu" else self.profile

    def holds_fetch(self, calls: int) -> bool:
        """Whether the next ``calls`` decode calls all fetch every miss: all-fetch is held
        and no arm begins among them (:meth:`tick` starts the first after ``wait`` calls of
        each layer), or all of them fall in the all-fetch arm, which is then timed as held
        all-fetch runs (in a decode graph with no CPU share)."""
        if self._restart:
            return False
        if self.phase == "wait":
            return self.choice == "fetch" and self._calls + calls <= self._wait * self.layers
        return self.phase == "fetch" and calls <= self._left()

    def _left(self) -> int:
        """Calls still to come in the arm under way, at least (the first call of the next arm
        is the one whose tick ends this one: at its end, or CHECK_STOP calls in when it may
        stop there, :meth:`_behind`)."""
        stop = CHECK_STOP * self.layers
        end = stop if self._seconds and (self._settling or self._calls < stop) else (
            CHECK_ARM * self.layers)
        if self._settling:
            return CHECK_SETTLE * self.layers - self._calls + end - 1
        return end - 1 - self._calls

    def start_fetch(self) -> None:
        """Hold all-fetch from the start, the profile's and the cpu arm sitting the first
        check out as if they had lost once (the decode check measured the CPU's share slower
        than offload on this box); the model's split is still timed at each check."""
        self.choice = "fetch"
        for arm in ("profile", "cpu"):
            self._lost[arm], self._sitout[arm] = 1, 1

    def hold(self, arm: str) -> None:
        """Hold ``arm`` with no check to come (a benchmark or test of one arm)."""
        self.choice, self._wait = arm, 2**62

    def tick(self, rows: int) -> None:
        """A call of ``rows`` token rows starts (before its split is chosen)."""
        now = self.clock()
        gap, self._last = now - self._last, now
        if rows > DECODE_ROWS:
            self._restart = self.phase != "wait"
            return
        if self.phase != "wait" and rows != self._rows:  # another batch: every arm again
            self.phase, self._restart, self._settling = self._arms[0], True, True
            self._rows, self._seconds = rows, {}
        idle = self._calls > 0 and gap > IDLE_GAP * (now - gap - self._t0) / self._calls
        if self._restart or (self.phase != "wait" and idle):  # the arm's first call again
            self._restart, self._calls, self._t0 = False, 0, now
            return
        self._calls += 1
        self.arm_calls += self.phase != "wait"
        if self.phase == "wait":
            if self._calls > self._wait * self.layers:  # this call starts the first arm
                arms = [a for a in self.arms if not self._sits(a)]
                # the held arm first: it goes on as the calls before it ran (no switch), and
                # every other arm has its time to be CHECK_EARLY behind
                self._arms = (self.choice, *(a for a in arms if a != self.choice))
                self._start(self._arms[0], now)
                self._rows, self._seconds = rows, {}
            return
        if self._settling:  # the switch's cost is behind from this call: time from here
            if self._calls >= CHECK_SETTLE * self.layers:
                self._settling, self._calls, self._t0 = False, 0, now
            return
        if self._calls < CHECK_ARM * self.layers and not self._behind(now):
            return
        # this call is the first after the arm (or after the calls that show it losing)
        self._seconds[self.phase] = (now - self._t0) / self._calls
        arms = self._arms
        if self.phase != arms[-1]:
            self._start(arms[arms.index(self.phase) + 1], now)
            return
        self._judge(self._seconds)
        self.phase, self._calls = "wait", 1

    def skip(self) -> None:
        """A call the check must not time (a step that fetches every miss whatever the arm
        holds): the arm it falls in starts again, as for a prompt's call."""
        self._last = self.clock()
        self._restart = self.phase != "wait"

    def _behind(self, now: float) -> bool:
        """Whether the arm, CHECK_STOP calls into its timed ones, is already CHECK_EARLY
        slower than the fastest arm this check has timed (it stops there)."""
        if self._calls != CHECK_STOP * self.layers or not self._seconds:
            return False
        return (now - self._t0) / self._calls > (1 + CHECK_EARLY) * min(self._seconds.values())

    def _sits(self, arm: str) -> bool:
        """Whether ``arm`` sits this check out (counting it off)."""
        left = self._sitout.get(arm, 0)
        if left == 0 or arm in ("split", self.choice):
            return False
        self._sitout[arm] = left - 1
        return True

    def _start(self, arm: str, now: float) -> None:
        self.phase, self._calls, self._t0, self._settling = arm, 0, now, True

    def _judge(self, seconds: dict[str, float]) -> None:
        held = seconds[self.choice]
        best = min(seconds, key=seconds.__getitem__)
        choice = best if seconds[best] < (1 - CHECK_MARGIN) * held else self.choice
        if choice != self.choice:
            log.info("hybrid %s: %s (us a layer call: %s); next check in %d tokens",
                     self.name or "layers", _HELD[choice],
                     ", ".join(f"{arm} {1e6 * t:.0f}" for arm, t in seconds.items()),
                     min(2 * self._wait, CHECK_LONGEST))
        self.choice = choice
        for arm, t in seconds.items():
            lost = self._lost[arm] = (self._lost.get(arm, 0) + 1
                                      if t > (1 + CHECK_DROP) * seconds[choice] else 0)
            self._sitout[arm] = min(2 ** (lost - 1), CHECK_SITOUT) if lost else 0
        self.verdicts = [*self.verdicts[-15:], Verdict(dict(seconds), choice)]
        self._wait = min(2 * self._wait, CHECK_LONGEST)


_HELD = {"fetch": "the CPU's share costs the step, so it gets no experts",
         "split": "the online split is the fastest, so it is followed",
         "profile": "the profile's split is the fastest, so it is held",
         "cpu": "every routed pair on the CPU is the fastest, so nothing is fetched"}
