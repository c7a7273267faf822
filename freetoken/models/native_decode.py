"""CPU float32 decode with each pre-norm MoE decoder layer as one native call.

With the experts and the dense matrices on the CPU pool (``--moe-strategy cpu --cpu-dense
pool``), a decode step's time is the pool's jobs plus the engine thread's own work between
them: norms, rotary, attention, the router's top-k, residual adds. Driven from Python those
steps cost more in call overhead than they compute (about 0.4 ms a layer on the GPU machine's
Xeon). ``csrc/decode_layer.cpp`` runs them, and submits the layer's four pool jobs, from C++.

It calls the same library functions and kernels as the modules, in the same order, so the
result is the same bits; the modules (``Qwen3MoeDecoderLayer.forward``) are its slow twin and
run for everything else: prefill, other devices and dtypes, layers it does not fit.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from freetoken.cpu.abi import DecodeLayer, DecodeStep
from freetoken.cpu.executor import CpuMoeExecutor
from freetoken.cpu.library import optional
from freetoken.layers.context import ForwardContext
from freetoken.layers.norm import RMSNorm
from freetoken.layers.pool_linear import PoolLinear
from freetoken.moe.cpu import CpuExperts

log = logging.getLogger(__name__)


def _f32(t: torch.Tensor) -> bool:
    return t.dtype is torch.float32 and t.is_cpu and t.is_contiguous()


def why_not(layer: nn.Module) -> str | None:
    """None when ``layer`` fits the native decode layer, else what does not."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None or not isinstance(getattr(mlp, "experts", None), CpuExperts):
        return "not an attention + MoE layer with experts on the CPU pool"
    projs = [attn.q_proj, attn.k_proj, attn.v_proj]
    if not all(isinstance(p, PoolLinear) for p in [*projs, attn.o_proj, mlp.gate]):
        return "its matrices are not on the pool (--cpu-dense pool)"
    group = attn.q_proj.group
    if group is None or group.members != projs or group.linear_id() is None:
        return "q, k and v do not stack into one matrix"
    if not mlp.gate.exact:
        return "its router is not float32"
    norms = [layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm]
    if not all(isinstance(n, RMSNorm) and not n.unit_offset and _f32(n.weight) for n in norms):
        return "its norms are not plain float32 RMSNorms"
    if len({n.eps for n in norms}) != 1:
        return "its norms differ in eps"
    if attn.window or not _f32(attn.rotary.cos):
        return "sliding-window attention or non-float32 rotary tables"
    return None


class NativeDecodeLayer:
    """One layer's descriptor for ``ft_decode_layer``; built at the first decode step (the
    pool ids exist by then) and rebuilt if the KV cache changes. ``steps`` is shared by the
    model's layers."""

    def __init__(self, layer: nn.Module, steps: StepCache, pool: CpuMoeExecutor) -> None:
        self.layer = layer
        self.steps = steps
        self.desc: DecodeLayer | None = None
        self._kv: object = None
        self._ex = pool

    def _build(self, ctx: ForwardContext) -> DecodeLayer:
        layer, attn, mlp = self.layer, self.layer.self_attn, self.layer.mlp
        experts = mlp.experts
        experts.registered or experts.register()
        if not (_f32(ctx.kv.k) and _f32(ctx.kv.v)):
            raise RuntimeError("the native decode layer writes a float32 KV cache on the CPU; "
                               f"this one is {ctx.kv.k.dtype} on {ctx.kv.k.device}")
        kc, vc = ctx.kv.k[attn.layer], ctx.kv.v[attn.layer]
        self._kv = ctx.kv
        return DecodeLayer(
            input_norm=layer.input_layernorm.weight.data_ptr(),
            post_norm=layer.post_attention_layernorm.weight.data_ptr(),
            q_norm=attn.q_norm.weight.data_ptr(), k_norm=attn.k_norm.weight.data_ptr(),
            eps=layer.input_layernorm.eps, qkv=attn.q_proj.group.linear_id(),
            o=attn.o_proj.linear_id(), router=mlp.gate.linear_id(), moe=experts.shape.layer,
            H=layer.input_layernorm.weight.shape[0], Hq=attn.n_q, Hkv=attn.n_kv,
            D=attn.head_dim, E=experts.shape.num_experts, A=mlp.top_k,
            renormalise=int(mlp.norm_topk_prob), scale=attn.scale, k_cache=kc.data_ptr(),
            v_cache=vc.data_ptr(), cos=attn.rotary.cos.data_ptr(),
            sin=attn.rotary.sin.data_ptr(), P=attn.rotary.cos.shape[0],
        )

    def __call__(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if self.desc is None or ctx.kv is not self._kv:
            self.desc = self._build(ctx)
        step = self.steps.get(ctx)
        y = x.clone(memory_format=torch.contiguous_format)  # the library updates it in place
        self._ex.decode_layer(self.layer.self_attn.layer, self.desc, step, y)
        return y


class StepCache:
    """The decode step's shared descriptor, built once per ForwardContext for all layers."""

    def __init__(self) -> None:
        self._ctx: ForwardContext | None = None
        self._step: DecodeStep | None = None
        self._keep: tuple[torch.Tensor, ...] = ()

    def get(self, ctx: ForwardContext) -> DecodeStep:
        if ctx is not self._ctx:
            B, S = ctx.k_slots.shape
            keep = (ctx.positions.contiguous(), ctx.slots.contiguous(),
                    ctx.k_slots.contiguous(), ctx.masks[0].reshape(B, S).contiguous())
            self._step = DecodeStep(*(t.data_ptr() for t in keep), B, S)
            self._ctx, self._keep = ctx, keep  # the tensors outlive the step's pointers
        assert self._step is not None
        return self._step


def attach_native_decode(model: nn.Module, pool: CpuMoeExecutor) -> int:
    """Give every layer of ``model`` that fits (see :func:`why_not`) a ``native`` decode path
    on ``pool`` (the pool its experts and matrices are on) and the model a shared step cache;
    returns how many layers got one. Call after the weights are loaded. Nothing is attached
    where the library lacks the function."""
    if optional("ft_decode_layer") is None:
        return 0
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return 0
    steps = StepCache()
    attached = 0
    for layer in layers:
        reason = why_not(layer)
        if reason is None and hasattr(layer, "native"):
            layer.native = NativeDecodeLayer(layer, steps, pool)
            attached += 1
        elif reason is not None:
            log.debug("layer %s decodes through its modules: %s",
                      getattr(layer.self_attn, "layer", "?"), reason)
    return attached
