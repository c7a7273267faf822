"""How we run a model: :class:`EngineConfig` (the flags once validated), the expert cache's
sizing (:class:`CacheSizing`) and the defaults the flags share."""

from __future__ import annotations

from dataclasses import dataclass


def human_bytes(n: float) -> str:
    """``4GB``, ``9.44MB``, ``512KB``: decimal units, three significant digits."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{int(n)}B"


@dataclass(frozen=True)
class CacheSizing:
    """One of the mutually exclusive expert-cache flags; slots are worked out after the weights
    are loaded (``moe/plan.py:plan_moe_cache``), when each layer's expert size is known.

    kind: ``mem`` (value in bytes), ``rate`` (fraction of all experts), ``size`` (slots), or
    ``auto`` (the device memory the weights leave, less the KV floor), which the MoE plan
    turns into ``mem`` with ``from_auto`` set (:meth:`resolved`) before the model is built.
    """

    kind: str = "auto"
    value: float = 0.0
    from_auto: bool = False  # a ``mem`` budget the plan worked out for --moe-cache-auto

    @staticmethod
    def resolved(budget: int) -> CacheSizing:
        """``--moe-cache-auto`` made concrete: ``budget`` bytes."""
        return CacheSizing("mem", float(budget), from_auto=True)

    def describe(self) -> str:
        if self.from_auto or self.kind == "auto":
            return "--moe-cache-auto"
        if self.kind == "mem":
            return f"--moe-cache-mem {human_bytes(self.value)}"
        if self.kind == "rate":
            return f"--moe-cache-rate {self.value:g}"
        if self.kind == "size":
            return f"--moe-cache-size {int(self.value)}"
        return self.kind


# Idle CPU pool workers spin this long for the next job before they sleep (--moe-cpu-spin-us):
# decode hands the pool one job per layer a fraction of a millisecond apart, and a futex
# wake-up costs tens of microseconds in a VM.
MOE_CPU_SPIN_US = 1000
KV_RESERVE_TOKENS = 8192  # KV tokens --moe-cache-auto leaves room for (--kv-reserve-tokens)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model, as the flags ask once validated.

    Device, dtype, graphs and ``cpu_dense`` are resolved (no ``auto``). The MoE requests
    (``moe_strategy``, ``moe_cache``, ``moe_cpu_threads``, ``moe_hybrid_max_fetch``) may still
    say ``auto``: resolving them needs the checkpoint and the device's free memory, so
    ``moe/plan.py:plan_moe`` turns them into a frozen, logged ``MoEPlan`` in the engine
    process, before the model is built.
    """

    model: str
    device: str
    dtype: str  # torch dtype name used for compute: float32, bfloat16, float16
    moe_strategy: str  # a registered strategy, or "auto" (per layer, by the plan)
    max_seq_len: int
    cuda_graph_max_bs: int = 0  # 0: decode runs eagerly (always on the CPU)
    moe_cpu_threads: int = 0  # CPU expert workers (0: one per usable core but the first)
    moe_cpu_spin_us: int = MOE_CPU_SPIN_US  # how long idle CPU workers spin, then sleep
    moe_cache: CacheSizing = CacheSizing()  # the expert cache of offloaded layers
    kv_reserve_tokens: int = KV_RESERVE_TOKENS
    # hybrid: experts fetched per layer call at most, or "auto" (from the profile row)
    moe_hybrid_max_fetch: int | str = "auto"
    moe_hybrid_online: bool = True  # hybrid corrects its fetch fraction from measured times
    # hybrid in a step with a greedy sequence: "fetch" every miss (offload's bits) or "split"
    moe_hybrid_greedy: str = "fetch"
    # cached layers fetch the next layer's predicted experts early: "auto" (offload only),
    # "on" (hybrid too) or "off"
    moe_lookahead: str = "auto"
    cpu_dense: str = "torch"  # dense layers on the CPU: "torch" (f32/bf16) or "pool" (own format)
