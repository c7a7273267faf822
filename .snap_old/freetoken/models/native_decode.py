"""CPU float32 decode with each decoder layer as one native call.

With the dense matrices (and the experts, if any) on the CPU pool (``--cpu-dense pool``), a
decode step's time is the pool's jobs plus the engine thread's own work between them: norms,
rotary, attention, the router's top-k or the MLP's activation, residual adds. Driven from
Python those steps cost more in call overhead than they compute (about 0.4 ms a layer, on the
GPU machine's Xeon and on a two-core development box alike). ``csrc/decode_layer.cpp`` runs
them, and submits the layer's pool jobs, from C++: the pre-norm MoE layers of Qwen3-MoE and the
sandwich-norm layers of Gemma-3 (output norms, scales 1 + w, sliding windows), dense or MoE.

It calls the same library functions and kernels as the modules, in the same order, so the
result is the same bits; the modules (``Qwen3MoeDecoderLayer.forward``,
``Gemma3DecoderLayer.forward``) are its slow twin and run for everything else: prefill, other
devices and dtypes, layers it does not fit.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from freetoken.cpu.abi import DecodeLayer, DecodeStep
from freetoken.cpu.executor import CpuMoeExecutor
from freetoken.cpu.library import ACTIVATIONS, optional
from freetoken.layers.context import ForwardContext
from freetoken.layers.norm import RMSNorm
from freetoken.layers.pool_linear import PoolLinear
from freetoken.moe.cpu import CpuExperts

log = logging.getLogger(__name__)


def _f32(t: torch.Tensor) -> bool:
    return t.dtype is torch.float32 and t.is_cpu and t.is_contiguous()


def _norms(layer: nn.Module) -> tuple[RMSNorm, RMSNorm | None, RMSNorm, RMSNorm | None]:
    """(before attention, after attention, before the MLP, after the MLP): a sandwich-norm
    layer (Gemma-3) has all four, a pre-norm one (Qwen3-MoE) the first and third."""
    if hasattr(layer, "pre_feedforward_layernorm"):
        return (layer.input_layernorm, layer.post_attention_layernorm,
                layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm)
    return layer.input_layernorm, None, layer.post_attention_layernorm, None


def _stacked(members: list[nn.Module]) -> int | None:
    """The pool id of ``members`` stacked into one matrix, or None."""
    group = getattr(members[0], "group", None)
    if group is None or group.members != members:
        return None
    return group.linear_id()


def why_not(layer: nn.Module) -> str | None:
    """None when ``layer`` fits the native decode layer, else what does not."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None or not hasattr(layer, "input_layernorm"):
        return "not an attention + MLP layer"
    if getattr(attn, "sinks", None) is not None:
        return "its attention has sinks"
    if any(hasattr(layer, n) for n in ("experts", "router", "layer_scalar")):
        return "it has more than attention and one MLP (experts beside the MLP, a layer scale)"
    moe = isinstance(getattr(mlp, "experts", None), CpuExperts)
    if not moe and not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        return "its MLP is neither experts on the CPU pool nor a gated dense MLP"
    projs = [attn.q_proj, attn.k_proj, attn.v_proj]
    mats = [*projs, attn.o_proj] + ([mlp.gate] if moe else
                                    [mlp.gate_proj, mlp.up_proj, mlp.down_proj])
    if not all(isinstance(p, PoolLinear) for p in mats):
        return "its matrices are not on the pool (--cpu-dense pool)"
    if moe and not mlp.gate.exact:
        return "its router is not float32"
    if not moe and (_stacked([mlp.gate_proj, mlp.up_proj]) is None
                    or mlp.activation not in ACTIVATIONS):
        return "its MLP's gate and up do not stack into one matrix, or its activation is not " \
               "the library's"
    norms = [n for n in _norms(layer) if n is not None] + [attn.q_norm, attn.k_norm]
    if not all(isinstance(n, RMSNorm) and _f32(n.weight) and not getattr(n, "float_scale", False)
               for n in norms):
        return "its norms are not float32 RMSNorms of the library's kind"
    if len({n.eps for n in norms}) != 1 or len({n.unit_offset for n in norms}) != 1:
        return "its norms differ in eps or scale"
    if not _f32(attn.rotary.cos):
        return "non-float32 rotary tables"
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
        if not (_f32(ctx.kv.k) and _f32(ctx.kv.v)):
            raise RuntimeError("the native decode layer writes a float32 KV cache on the CPU; "
                               f"this one is {ctx.kv.k.dtype} on {ctx.kv.k.device}")
        kc, vc = ctx.kv.k[attn.layer], ctx.kv.v[attn.layer]
        self._kv = ctx.kv
        pre_attn, post_attn, pre_mlp, post_mlp = _norms(layer)
        qkv = _stacked([attn.q_proj, attn.k_proj, attn.v_proj])
        q, k, v = (-1, -1, -1) if qkv is not None else (
            attn.q_proj.linear_id(), attn.k_proj.linear_id(), attn.v_proj.linear_id())
        experts = getattr(mlp, "experts", None)
        if experts is not None:
            experts.registered or experts.register()
            mlp_fields = dict(router=mlp.gate.linear_id(), moe=experts.shape.layer,
                              E=experts.shape.num_experts, A=mlp.top_k,
                              renormalise=int(mlp.norm_topk_prob), gate_up=-1, down=-1)
        else:
            mlp_fields = dict(router=-1, moe=-1, gate_up=_stacked([mlp.gate_proj, mlp.up_proj]),
                              down=mlp.down_proj.linear_id(), I=mlp.down_proj.in_features,
                              act=ACTIVATIONS[mlp.activation])
        return DecodeLayer(
            input_norm=pre_attn.weight.data_ptr(), post_norm=pre_mlp.weight.data_ptr(),
            q_norm=attn.q_norm.weight.data_ptr(), k_norm=attn.k_norm.weight.data_ptr(),
            eps=pre_attn.eps, qkv=-1 if qkv is None else qkv, q=q, k=k, v=v,
            o=attn.o_proj.linear_id(), H=pre_attn.weight.shape[0], Hq=attn.n_q, Hkv=attn.n_kv,
            D=attn.head_dim, scale=attn.scale, k_cache=kc.data_ptr(), v_cache=vc.data_ptr(),
            cos=attn.rotary.cos.data_ptr(), sin=attn.rotary.sin.data_ptr(),
            P=attn.rotary.cos.shape[0], unit_offset=int(pre_attn.unit_offset),
            windowed=int(attn.window > 0),
            attn_out_norm=post_attn.weight.data_ptr() if post_attn is not None else None,
            ffn_out_norm=post_mlp.weight.data_ptr() if post_mlp is not None else None,
            **mlp_fields,
        )

    def __call__(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if self.desc is None or ctx.kv is not self._kv:
            self.desc = self._build(ctx)
        step = self.steps.get(ctx)
        y = x.clone(memory_format=torch.contiguous_format)  # the library updates it in place
        self._ex.decode_layer(self.layer.self_attn.layer, self.desc, step, y)
        return y


class StepCache:
    """The decode step's shared descriptor, built once per ForwardContext for all layers;
    ``window``: the sliding window of the model's windowed layers (0: none)."""

    def __init__(self, window: int = 0) -> None:
        self.window = window
        self._ctx: ForwardContext | None = None
        self._step: DecodeStep | None = None
        self._keep: tuple[torch.Tensor, ...] = ()

    def get(self, ctx: ForwardContext) -> DecodeStep:
        if ctx is not self._ctx:
            B, S = ctx.k_slots.shape
            keep = (ctx.positions.contiguous(), ctx.slots.contiguous(),
                    ctx.k_slots.contiguous(), ctx.masks[0].reshape(B, S).contiguous())
            local = None
            if self.window:
                local = ctx.masks[self.window].reshape(B, S).contiguous()
                keep += (local,)
            self._step = DecodeStep(*(t.data_ptr() for t in keep[:4]), B, S,
                                    local.data_ptr() if local is not None else None)
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
    windows = {layer.self_attn.window for layer in layers
               if getattr(getattr(layer, "self_attn", None), "window", 0)}
    if len(windows) > 1:
        log.debug("no native decode layers: the model's windows differ (%s)", sorted(windows))
        return 0
    steps = StepCache(windows.pop() if windows else 0)
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
