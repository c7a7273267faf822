"""The bandwidth profile (``ft bench bw``, version 6): one row per MoE layer kind.

Rows are keyed by a :class:`~freetoken.moe.layer_kind.LayerKind` and the CPU worker count.
File: ``$FREETOKEN_BENCHBW_PATH``, else ``<cache dir>/benchbw.json``; JSON
``{"version": 6, "layer_kinds": {key: row}}``. Writers merge under an exclusive lock and
replace the file atomically, so readers need no lock. At startup each hybrid layer looks up its
row (:func:`lookup`) and fetches ``pcie_ov / (pcie_ov + cpu_ov)`` of its misses.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from freetoken import env
from freetoken.config import CacheSizing, human_bytes
from freetoken.errors import ConfigError
from freetoken.moe.decode_check import DecodeCheck
from freetoken.moe.layer_kind import (  # noqa: F401  (the profile's public names)
    PROJECTIONS,
    LayerKind,
    Options,
    cpu_format,
    layer_kinds,
    layer_kinds_from_formats,
    layer_span,
    parse_key,
)

log = logging.getLogger(__name__)

VERSION = 6
FETCH_CAP = 1  # experts a hybrid layer without a row fetches per step
HYBRID_MARGIN = 1.10  # overlapped CPU + PCIe must beat either alone by 10% to recommend hybrid
# the CPU alone must beat PCIe alone by 50% to recommend cpu over offload: offload also gets
# the expert cache's hits, which the profile does not see (11 % at 4 GB on the default router)
CPU_MARGIN = 1.50

How = Literal["exact", "nearest_shape", "nearest_threads", "missing"]


class ProfileError(ConfigError):
    """The profile file exists but cannot be used (unreadable JSON, wrong structure, bad row)."""


@dataclass(frozen=True)
class Row:
    """One benched layer kind, GB/s: CPU MoE and PCIe gather, each alone and overlapped.

    ``meta`` is outside the key: isa, cores, activation, gpu, cpu_model, sources (checkpoint
    paths or presets), threshold, time, commit. ``decode``: the model's decode check
    (``ft bench bw --decode-check``), which auto weighs above the GB/s.
    """

    cpu_gbps: float
    pcie_gbps: float
    cpu_overlapped_gbps: float
    pcie_overlapped_gbps: float
    meta: Mapping[str, Any] = field(default_factory=dict, hash=False)
    decode: DecodeCheck | None = None

    def __post_init__(self) -> None:
        for name in ("cpu_gbps", "pcie_gbps", "cpu_overlapped_gbps", "pcie_overlapped_gbps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < math.inf:
                raise ValueError(f"{name} must be a positive number of GB/s, got {v!r}")
        if not isinstance(self.meta, Mapping):
            raise ValueError(f"meta must be an object, got {type(self.meta).__name__}")

    @property
    def fraction(self) -> float:
        """Share of a layer's misses to fetch over PCIe; the CPU computes the rest."""
        return self.pcie_overlapped_gbps / (self.pcie_overlapped_gbps + self.cpu_overlapped_gbps)

    @property
    def recommended(self) -> Literal["hybrid", "offload", "cpu"]:
        """``hybrid`` when overlapped CPU + PCIe beats PCIe alone and the CPU alone by
        HYBRID_MARGIN (10%: the split's planning and fetches cost the step time); else ``cpu``
        when the CPU alone beats PCIe alone by CPU_MARGIN (on the H200 box, where the two
        overlapped add little since the link's reads share the CPU's memory bandwidth, cpu
        decoded 44 tok/s against hybrid's 38); else ``offload``."""
        both = self.cpu_overlapped_gbps + self.pcie_overlapped_gbps
        if both > HYBRID_MARGIN * max(self.pcie_gbps, self.cpu_gbps):
            return "hybrid"
        return "cpu" if self.cpu_gbps > CPU_MARGIN * self.pcie_gbps else "offload"

    def to_json(self) -> dict[str, Any]:
        return {"cpu_gbps": self.cpu_gbps, "pcie_gbps": self.pcie_gbps,
                "cpu_overlapped_gbps": self.cpu_overlapped_gbps,
                "pcie_overlapped_gbps": self.pcie_overlapped_gbps, "meta": dict(self.meta),
                **({"decode": self.decode.to_json()} if self.decode is not None else {})}

    @staticmethod
    def from_json(obj: Any) -> Row:
        """A row from its JSON object; ValueError says what is wrong."""
        if not isinstance(obj, dict):
            raise ValueError(f"a row must be an object, got {type(obj).__name__}")
        want = ("cpu_gbps", "pcie_gbps", "cpu_overlapped_gbps", "pcie_overlapped_gbps")
        missing = [k for k in want if k not in obj]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
        decode = obj.get("decode")
        return Row(obj["cpu_gbps"], obj["pcie_gbps"], obj["cpu_overlapped_gbps"],
                   obj["pcie_overlapped_gbps"], obj.get("meta", {}),
                   None if decode is None else DecodeCheck.from_json(decode))


@dataclass(frozen=True)
class Profile:
    """The rows of one profile file (empty when it is missing or of an older version)."""

    path: Path
    rows: Mapping[str, Row] = field(default_factory=dict)


def profile_path() -> Path:
    """``$FREETOKEN_BENCHBW_PATH``, else ``<cache dir>/benchbw.json``."""
    return env.benchbw_path() or env.cache_dir() / "benchbw.json"


def load_profile(path: str | Path | None = None) -> Profile:
    """The profile at ``path`` (default :func:`profile_path`). A missing file is an empty profile;
    an older version is empty with a warning; anything unusable raises ProfileError."""
    target = Path(path) if path is not None else profile_path()
    rows, old = _read(target)
    if old is not None:
        log.warning("bandwidth profile %s is version %s; version %d is needed, so it is ignored: "
                    "rerun ft bench bw", target, old, VERSION)
    return Profile(target, rows)


def load_profile_or_empty(path: str | Path | None = None) -> Profile:
    """:func:`load_profile`, but an unusable file is logged as a warning and read as empty."""
    try:
        return load_profile(path)
    except ProfileError as e:
        log.warning("%s; serving without it", e)
        return Profile(Path(path) if path is not None else profile_path())


def save_rows(rows: Mapping[str, Row], path: str | Path | None = None) -> Path:
    """Merge ``rows`` into the profile: they replace rows of the same key, the rest stay.

    Runs under an exclusive lock on ``<file>.lock`` and replaces the file atomically. An older
    version is replaced; an unusable file is moved aside to ``<file>.damaged`` with a warning.
    """
    target = Path(path) if path is not None else profile_path()
    for key, row in rows.items():
        parse_key(key)
        if not isinstance(row, Row):
            raise TypeError(f"row {key} is a {type(row).__name__}, not a Row")
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target):
        try:
            old, version = _read(target)
        except ProfileError as e:
            aside = target.with_name(target.name + ".damaged")
            os.replace(target, aside)
            log.warning("%s; moved it to %s and writing a new profile", e, aside)
            old, version = {}, None
        if version is not None:
            log.info("replacing version %s bandwidth profile %s", version, target)
        merged = {**old, **rows}
        doc = {"version": VERSION,
               "layer_kinds": {k: merged[k].to_json() for k in sorted(merged)}}
        _write_atomic(target, json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return target


def _read(path: Path) -> tuple[dict[str, Row], int | str | None]:
    """(rows, None), or ({}, the version found) for a profile older than VERSION."""
    def bad(why: str) -> ProfileError:
        return ProfileError(f"bandwidth profile {path} is unusable ({why}); rerun ft bench bw to "
                            "rewrite it, or delete the file")

    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}, None
    except (OSError, UnicodeDecodeError) as e:
        raise bad(f"cannot read it: {e}") from e
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad(f"not JSON: {e}") from e
    if not isinstance(doc, dict):
        raise bad(f"the top level is a {type(doc).__name__}, not an object")
    version = doc.get("version")
    if version is None:
        return {}, "unknown (no version field)"
    if isinstance(version, bool) or not isinstance(version, int):
        raise bad(f"version {version!r} is not a number")
    if version < VERSION:
        return {}, version
    if version > VERSION:
        raise bad(f"version {version} is newer than this freetoken reads ({VERSION})")
    kinds = doc.get("layer_kinds")
    if not isinstance(kinds, dict):
        raise bad("no layer_kinds object")
    rows: dict[str, Row] = {}
    for key, obj in kinds.items():
        try:
            parse_key(key)
            rows[key] = Row.from_json(obj)
        except ValueError as e:
            raise bad(f"row {key!r}: {e}") from e
    return rows, None


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class Match:
    """How a layer kind found its row: ``wanted`` key, ``used`` key (None when missing)."""

    wanted: str
    how: How
    used: str | None = None
    row: Row | None = None

    def unlike(self, threads: int, isa: str, cpu: str) -> str | None:
        """What makes the row's measurement unlike a run with ``threads`` workers at ``isa`` on
        a ``cpu`` (another thread count, ISA tier or CPU model), or None when it was measured
        as this run will compute. A row not measured here says little about whether the CPU
        share pays here: a 15-thread AVX-512 row recommends hybrid where 3 AVX2 threads
        lose to offload."""
        if self.row is None:
            return "missing"
        meta, parts = self.row.meta, []
        if self.how == "nearest_threads":
            parts.append(f"at another thread count ({self.used})")
        if meta.get("isa") not in (None, isa):
            parts.append(f"at {meta['isa']}, not {isa}")
        if meta.get("cpu_model") not in (None, cpu):
            parts.append(f"on a {meta['cpu_model']}, not this {cpu}")
        return "; ".join(parts) or None

    def check_at(self, cache: CacheSizing) -> DecodeCheck | None:
        """The row's decode check where it was made at this ``cache``, else None."""
        check = self.row.decode if self.row is not None else None
        return check if check is not None and check.applies(cache) else None

    @property
    def fraction(self) -> float | None:
        """Share of misses to fetch over PCIe, or None when the layer has no row."""
        return self.row.fraction if self.row is not None else None

    @property
    def max_fetch(self) -> int | None:
        """The fixed fetch cap of a layer without a row (FETCH_CAP), else None."""
        return None if self.row is not None else FETCH_CAP


def shape_distance(a: LayerKind, b: LayerKind) -> float:
    """How far apart two expert shapes are: log ratios of hidden * intermediate and of top-k."""
    size = (a.hidden * a.moe_intermediate) / (b.hidden * b.moe_intermediate)
    return abs(math.log(size)) + abs(math.log(a.top_k / b.top_k))


def lookup(
    profile: Profile, kind: LayerKind, threads: int, layers: list[int] | None = None,
    checkpoint: str | Path | None = None,
) -> Match:
    """The row for ``kind`` at ``threads`` CPU workers.

    Exact key; else the same format, options and threads with the nearest shape (info log);
    else the same format and options with the nearest thread count, ties to fewer threads, then
    the nearest shape (info log); else missing: cap FETCH_CAP with a warning naming the key.
    Ties always break on the key, so the choice is deterministic. ``layers`` and ``checkpoint``
    only make the log lines concrete.
    """
    wanted = kind.key(threads)
    where = f" (layers {layer_span(layers)})" if layers else ""
    if wanted in profile.rows:
        return Match(wanted, "exact", wanted, profile.rows[wanted])
    parsed = {k: parse_key(k) for k in profile.rows}
    ours = (kind.fmt, kind.options)
    same = [(k, c, t) for k, (c, t) in parsed.items() if (c.fmt, c.options) == ours]
    close = [(shape_distance(kind, c), k) for k, c, t in same if t == threads]
    if close:
        used = min(close)[1]
        log.info("bandwidth profile: no row for %s%s; using %s (same format and threads, "
                 "nearest shape)", wanted, where, used)
        return Match(wanted, "nearest_shape", used, profile.rows[used])
    if same:
        used = min((abs(t - threads), t, shape_distance(kind, c), k) for k, c, t in same)[3]
        log.info("bandwidth profile: no row for %s%s; using %s (same format, nearest thread "
                 "count)", wanted, where, used)
        return Match(wanted, "nearest_threads", used, profile.rows[used])
    log.warning("bandwidth profile %s has no row for %s%s: those hybrid layers fetch at most %d "
                "expert per step and compute the other misses on the CPU; run ft bench bw "
                "--model %s", profile.path, wanted, where, FETCH_CAP, checkpoint or "<checkpoint>")
    return Match(wanted, "missing")


def plan_fractions(
    profile: Profile, kinds: Mapping[LayerKind, list[int]], threads: int,
    checkpoint: str | Path | None = None,
) -> dict[int, Match]:
    """Per MoE layer index, the match of its kind (one lookup and one log line per kind)."""
    plan: dict[int, Match] = {}
    for kind, layers in kinds.items():
        match = lookup(profile, kind, threads, layers, checkpoint)
        plan.update(dict.fromkeys(layers, match))
    return dict(sorted(plan.items()))


def format_table(rows: Mapping[str, Row]) -> str:
    """The rows as a plain-text table (GB/s), one line per key in key order; with a decode
    check, its figures and what auto runs at its cache."""
    head = ("Layer kind", "CPU MoE", "PCIe gather", "Overlapped CPU / PCIe", "Fraction",
            "Recommended", "Decode check")
    body = [(k, f"{r.cpu_gbps:.1f}", f"{r.pcie_gbps:.1f}",
             f"{r.cpu_overlapped_gbps:.1f} / {r.pcie_overlapped_gbps:.1f}",
             f"{100 * r.fraction:.1f}%", r.recommended, _check_words(r))
            for k, r in sorted(rows.items())]
    widths = [max(len(line[i]) for line in (head, *body)) for i in range(len(head))]
    if not any(line[6] for line in body):
        head, body, widths = head[:6], [line[:6] for line in body], widths[:6]
    return "\n".join(
        "  ".join(cell.ljust(w) if i in (0, 5, 6) else cell.rjust(w)
                  for i, (cell, w) in enumerate(zip(line, widths, strict=True))).rstrip()
        for line in (head, *body)
    )


def _check_words(row: Row) -> str:
    check = row.decode
    if check is None:
        return ""
    rec = row.recommended
    verdict = "auto offloads" if check.loses(rec) else f"auto runs {rec}"
    return f"{check.words()} at {human_bytes(check.cache_bytes)}: {verdict}"
