"""Fill a model's parameters from a checkpoint, dequantising each tensor on the target device.

Expert tensors arrive stacked (GGUF: ``...mlp.experts.gate_proj``, E x out x in), per expert
(HF: ``...mlp.experts.3.gate_proj.weight``), or fused (HF v5: ``...mlp.experts.gate_up_proj``);
all three land in the same stacked parameters.
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn
from tqdm import tqdm

from freetoken.checkpoint import Checkpoint
from freetoken.errors import CheckpointError
from freetoken.quant import QuantTensor, get_format

log = logging.getLogger(__name__)

# experts sit under the MLP (``...mlp.experts``) or beside it (Gemma-4: ``...layers.N.experts``)
_PER_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"(.*\.experts)\.gate_up_proj$")
_STACKED = re.compile(r"(.*\.experts)\.(gate_proj|up_proj|down_proj|gate_up_proj)$")


def load_weights(
    model: nn.Module, ckpt: Checkpoint, device: torch.device, progress: bool = True
) -> None:
    """Copy every checkpoint tensor into ``model``; raise if a parameter stays unfilled."""
    params = dict(model.named_parameters(remove_duplicate=False))
    filled: set[str] = set()
    expert_rows: dict[str, int] = {}
    # Experts that keep checkpoint tensors in their own format (the cpu strategy) take them
    # undequantised; everything else lands in parameters.
    hooks = {n: m for n, m in model.named_modules() if hasattr(m, "load_expert_tensor")}
    # Dense layers that multiply their weight in its own format (PoolLinear) take it as is.
    dense = {f"{n}.weight": m for n, m in model.named_modules()
             if hasattr(m, "load_weight_tensor")}
    # ... and one that shares another tensor (a tied head) takes that tensor as well.
    sharing = {m.ties: m for m in dense.values() if getattr(m, "ties", None)}
    names = ckpt.tensor_names()
    bar = tqdm(total=len(names), desc="Loading weights", unit="tensor", disable=not progress,
               leave=False)
    for name, qt in ckpt.tensors():
        bar.update(1)
        if hooks and _hand_over(hooks, name, qt):
            continue
        if name in sharing:
            sharing[name].load_weight_tensor(qt)
        if name in dense:
            dense[name].load_weight_tensor(qt)
            continue
        if name in params:
            _copy(params[name], qt, device, name)
            filled.add(name)
        elif m := _PER_EXPERT.match(name):
            target = f"{m.group(1)}.{m.group(3)}"
            _copy(_param(params, target, name)[int(m.group(2))], qt, device, name)
            expert_rows[target] = expert_rows.get(target, 0) + 1
            if expert_rows[target] == params[target].shape[0]:
                filled.add(target)
        elif m := _FUSED.match(name):
            gate = _param(params, f"{m.group(1)}.gate_proj", name)
            full = _dequantize(qt, device)
            gate.copy_(full[:, : gate.shape[1]])
            params[f"{m.group(1)}.up_proj"].copy_(full[:, gate.shape[1]:])
            filled.update({f"{m.group(1)}.gate_proj", f"{m.group(1)}.up_proj"})
        else:
            log.debug("checkpoint tensor %s is not used", name)
    bar.close()
    tied = {n for n, p in params.items() if n == "lm_head.weight"
            and p is params.get("model.embed_tokens.weight")}
    missing = sorted(set(params) - filled - tied)
    missing += [f"{n}.{t}" for n, h in hooks.items() for t in h.missing_expert_tensors()]
    missing += [n for n, m in dense.items() if m.missing_weight()]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(
            f"{ckpt.path} lacks weights the model needs: {', '.join(missing[:5])}{more}"
        )


def _hand_over(hooks: dict[str, nn.Module], name: str, qt: QuantTensor) -> bool:
    """Give an expert tensor to the module that keeps its own experts; False if none does."""
    if (m := _PER_EXPERT.match(name)) and m.group(1) in hooks:
        return bool(hooks[m.group(1)].load_expert_tensor(m.group(3), qt, int(m.group(2))))
    if (m := _STACKED.match(name)) and m.group(1) in hooks:
        return bool(hooks[m.group(1)].load_expert_tensor(m.group(2), qt))
    return False


def _param(params: dict[str, nn.Parameter], target: str, source: str) -> nn.Parameter:
    if target not in params:
        raise CheckpointError(f"checkpoint tensor {source} has no place in the model ({target})")
    return params[target]


def _dequantize(qt: QuantTensor, device: torch.device) -> torch.Tensor:
    data = qt.data.to(device, non_blocking=False)
    scales = {k: v.to(device) for k, v in qt.scales.items()}
    return get_format(qt.fmt).dequantize(QuantTensor(qt.fmt, qt.shape, data, scales))


@torch.no_grad()
def _copy(dst: torch.Tensor, qt: QuantTensor, device: torch.device, name: str) -> None:
    if tuple(dst.shape) != tuple(qt.shape):
        raise CheckpointError(
            f"tensor {name} has shape {tuple(qt.shape)} in the checkpoint but the config implies "
            f"{tuple(dst.shape)}; the checkpoint and its config.json disagree"
        )
    if qt.fmt in ("f32", "f16", "bf16"):
        dst.copy_(qt.data)
    else:
        dst.copy_(_dequantize(qt, device))
