"""What ``decode_moe.py`` reads off an engine's MoE layers after a run: the stats' counters
between two snapshots, hybrid's overlapped bandwidth and split costs, how much of a run was
the wall check's search or ran in the graphs for steps that fetch every miss, and the CPU
pool's timed jobs."""

from __future__ import annotations

from typing import Any

from freetoken.engine.engine import Engine
from freetoken.moe.cpu import CpuExperts

COUNTERS = ("tokens", "hits", "misses", "streamed", "bytes_fetched", "fetch_s", "compute_s",
            "cpu_experts", "cpu_s", "plan_s", "prefetched", "lookahead_used", "lookahead_needed")


def moe_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any]:
    """The stats' counters between two snapshots, totals and per layer, with the run's hit
    rates and bytes per token."""
    if not before or not after:
        return {}
    d = {k: after[k] - before[k] for k in COUNTERS}
    lookups = d["hits"] + d["misses"] + d["cpu_experts"]
    d["hit_rate"] = d["hits"] / lookups if lookups else 0.0
    d["bytes_per_token"] = d["bytes_fetched"] / d["tokens"] if d["tokens"] else 0.0
    d["lookahead_hit_rate"] = (d["lookahead_used"] / d["lookahead_needed"]
                               if d["lookahead_needed"] else None)
    d["layers"] = {
        k: {c: after["layers"][k][c] - before["layers"][k][c] for c in COUNTERS[1:]}
        for k in after["layers"]}
    return d


def hybrid_roofline_gbps(engine: Engine) -> float | None:
    """Overlapped CPU + PCIe GB/s of the model's first hybrid layer kind, from the profile."""
    from freetoken.moe.hybrid import HybridExperts
    from freetoken.moe.profile import load_profile_or_empty, lookup

    layers = [m for m in engine.model.modules() if isinstance(m, HybridExperts)]
    if not layers or layers[0].executor is None:
        return None
    match = lookup(load_profile_or_empty(), layers[0].kind(), layers[0].executor.threads)
    if match.row is None:
        return None
    return match.row.cpu_overlapped_gbps + match.row.pcie_overlapped_gbps

def split_costs(engine: Engine) -> dict[str, dict[str, Any]]:
    """Per hybrid layer, the costs its online split uses (microseconds; layers of one kind
    share them), its fetched share and its kind's wall checks so far (each check's
    microseconds a layer call under each arm, and the arm it chose)."""
    from freetoken.moe.hybrid import HybridExperts

    def us(v: float | None) -> float | None:
        return None if v is None else round(v * 1e6, 1)

    def checks(m: HybridExperts) -> list[dict[str, Any]]:
        c = m.policy.costs.check
        return [] if c is None else [{**{f"{arm}_us": us(t) for arm, t in v.seconds.items()},
                                      "choice": v.choice} for v in c.verdicts]

    return {str(m.shape.layer): {"cpu_per_expert": us(m.policy.costs.c_cpu),
                                 "cpu_per_job": us(m.policy.costs.l_cpu),
                                 "pcie_per_expert": us(m.policy.costs.c_pcie),
                                 "overhead": us(m.policy.costs.o),
                                 "fraction": m.policy.fraction,
                                 "held": m.policy.held,
                                 "wall_checks": checks(m)}
            for m in engine.model.modules() if isinstance(m, HybridExperts)}

def search_tokens(engine: Engine) -> float:
    """Tokens whose calls the hybrid wall checks made under an arm so far (the kind with the
    most; a kind's calls over its layers), so a run can say how much of it was the search."""
    from freetoken.moe.hybrid import HybridExperts

    checks = {id(c): c for m in engine.model.modules() if isinstance(m, HybridExperts)
              and (c := m.policy.costs.check) is not None}
    return max((c.arm_calls / c.layers for c in checks.values()), default=0.0)

def fetching_steps(engine: Engine) -> int:
    """Decode steps run so far in the graphs made for steps that fetch every miss."""
    graphs = engine.runner.graphs
    return 0 if graphs is None else graphs.fetching_steps

def pool_jobs(engine: Engine, workers: int) -> dict[str, float]:
    """The timed jobs of every hybrid and cpu layer (``+timing``), in means (us): their
    experts, the pool's time, the first item's start, each phase's end and busy time (see
    ``cpu_moe.py``), and the pool's time per expert."""
    from benchmarks.cpu_moe import breakdown
    from freetoken.moe.hybrid import HybridExperts

    jobs = [j for m in engine.model.modules()
            for j in (m.calls.jobs.jobs if isinstance(m, HybridExperts)
                      else m.jobs.jobs if isinstance(m, CpuExperts) else ())]
    if not jobs:
        return {}
    experts = sum(e for _, _, e in jobs) / len(jobs)
    pool_s = sum(s for _, s, _ in jobs) / len(jobs)
    return {"jobs": len(jobs), "experts": round(experts, 2),
            **breakdown([t for t, _, _ in jobs], pool_s, workers),
            "pool_us_per_expert": round(1e6 * pool_s / experts, 1) if experts else 0.0}
