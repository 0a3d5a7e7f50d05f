"""Support for the MiMo-V2-Omni vision-sink tests (tests/vllm/test_mimo_vision_sinks.py).

Two facts of the CPU venvs shape this module:

* ``vllm.model_executor.models.mimo_v2_omni`` imports transformers' Qwen2-VL image processor, which
  imports ``torchvision.transforms.v2.functional`` at module level. There is no CPU torchvision build
  here (PyPI's is a CUDA build that breaks the CPU torch), so :func:`import_vllm_mimo_v2_omni` puts
  a stand-in package in ``sys.modules`` for that one import. The stand-in raises on any use of an
  attribute; the tests never process images, they feed patches straight to the vision tower.
* vLLM 0.27.x's window attention calls ``vllm.vllm_flash_attn.flash_attn_varlen_func``, which needs
  the CUDA extensions. :func:`flash_attn_stand_in` computes what that call computes (bidirectional
  window, no sink) in plain PyTorch, so the tests can show what upstream 0.27.x gets wrong.

The references here are plain PyTorch, written from the model's definition, independent of the
Triton op and of the project's banded reference.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import math
import socket
import sys
import types
from typing import Iterator

import torch
import torch.nn.functional as F

_TORCHVISION_MODULES = (
    "torchvision",
    "torchvision.transforms",
    "torchvision.transforms.v2",
    "torchvision.transforms.v2.functional",
)


def _stand_in_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name, f"vllm-sinks test stand-in for {name} (no CPU build exists)")
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__path__ = []

    def __getattr__(attr: str, _name: str = name):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise RuntimeError(f"{_name}.{attr}: torchvision is a test stand-in here and cannot be used")

    module.__getattr__ = __getattr__
    return module


@contextlib.contextmanager
def torchvision_stand_in() -> Iterator[None]:
    """Provide a stand-in ``torchvision`` in ``sys.modules`` for the duration (no-op if real one imports).

    Enter it only after transformers has been imported: transformers decides whether torchvision is
    available when it is first imported, and must keep believing it is not.
    """
    try:
        importlib.import_module("torchvision.transforms.v2.functional")
        yield
        return
    except ImportError:
        pass
    mods = {name: _stand_in_module(name) for name in _TORCHVISION_MODULES}
    for name, module in mods.items():
        if "." in name:
            parent, child = name.rsplit(".", 1)
            setattr(mods[parent], child, module)
    saved = {name: sys.modules.get(name) for name in mods}
    sys.modules.update(mods)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def import_vllm_mimo_v2_omni() -> types.ModuleType:
    """``vllm.model_executor.models.mimo_v2_omni``, imported with the torchvision stand-in."""
    name = "vllm.model_executor.models.mimo_v2_omni"
    if name in sys.modules:
        return sys.modules[name]
    import vllm.config  # noqa: F401 - imports transformers first (see torchvision_stand_in)

    with torchvision_stand_in():
        return importlib.import_module(name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_single_rank_tp_group() -> None:
    """A one-process world on gloo with tensor parallel size 1 (what vLLM's layers look up)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return
    with set_current_vllm_config(VllmConfig()):
        if not torch.distributed.is_initialized() or ps._WORLD is None:
            ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
        ps.initialize_model_parallel(1)


@contextlib.contextmanager
def vllm_config_context() -> Iterator[None]:
    """vLLM's layers (custom ops, linear layers) read the current config while being built."""
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


# ---- references ----------------------------------------------------------------------------------


def dense_window_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                           window: int, sinks: torch.Tensor | None, semantics: str,
                           scale: float) -> torch.Tensor:
    """fp64 dense attention per sequence: |i − j| > window masked; sinks as ``key0`` bias or ``null`` logit.

    ``key0``: sinks[h] is added to each sequence's key-0 logit (for queries that see key 0).
    ``null``: one extra logit sinks[h] with no value in every query's softmax.
    """
    if semantics not in ("key0", "null"):
        raise ValueError(f"semantics must be key0 or null, got {semantics!r}")
    hq, hkv = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape[0], hq, v.shape[2], dtype=torch.float64)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs = q[start:end].double().transpose(0, 1)  # [Hq, n, D]
        ks = k[start:end].double().transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
        vs = v[start:end].double().transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
        logits = qs @ ks.transpose(1, 2) * scale  # [Hq, n, n]
        pos = torch.arange(end - start)
        hidden = (pos[:, None] - pos[None, :]).abs() > window
        if sinks is not None and semantics == "key0":
            logits[:, :, 0] += sinks.double()[:, None]
        logits = logits.masked_fill(hidden, -math.inf)
        if sinks is not None and semantics == "null":
            null = sinks.double()[:, None, None].expand(hq, end - start, 1)
            probs = torch.softmax(torch.cat([logits, null], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(logits, dim=-1)
        out[start:end] = (probs @ vs).transpose(0, 1)
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return (torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref)).item()


def _flash_attn_varlen_window_no_sink(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      softmax_scale=None, causal=False, window_size=(-1, -1), **kwargs):
    # What vLLM 0.27.x asks flash attention for: a symmetric window, bidirectional, and no sink.
    if causal or tuple(window_size)[0] != tuple(window_size)[1] or kwargs.get("s_aux") is not None:
        raise NotImplementedError("the stand-in covers only the call vLLM 0.27.x's MiMo makes")
    if not torch.equal(cu_seqlens_q, cu_seqlens_k):
        raise NotImplementedError("the stand-in covers self-attention only")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = dense_window_reference(q, k, v, cu_seqlens_q, int(window_size[0]), None, "key0", scale)
    return out.to(q.dtype)


@contextlib.contextmanager
def flash_attn_stand_in() -> Iterator[None]:
    """Stand in for ``vllm.vllm_flash_attn`` (CUDA-only) with a plain-PyTorch windowed attention."""
    name = "vllm.vllm_flash_attn"
    module = types.ModuleType(name, "vllm-sinks test stand-in: window attention without sinks")
    module.flash_attn_varlen_func = _flash_attn_varlen_window_no_sink
    saved = sys.modules.get(name)
    sys.modules[name] = module
    try:
        yield
    finally:
        if saved is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved


# ---- a tiny MiMo vision tower, and the same tower in plain PyTorch -------------------------------

TINY_TOWER = dict(
    depth=3, hidden_size=64, hidden_act="silu", intermediate_size=96, num_heads=4,
    num_key_value_heads=2, qk_channels=16, kv_channels=16, in_channels=3, patch_size=2,
    temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=48, fullatt_block_indexes=[0],
    vit_window_attn_types=[-1, 0, 1], visual_token_window_size=4, use_sink=True,
)
#: Two images (t, h, w in patches): 4×6 and 2×4 patches, so 24 + 8 tokens.
TINY_GRID_THW = [[1, 4, 6], [1, 2, 4]]


def build_tiny_tower(seed: int = 0) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """vLLM's ``MiMoVisionTransformer`` at :data:`TINY_TOWER`, fp32, random weights, sinks ~ N(0, 1).

    Returns the tower and a copy of its weights (vLLM's CPU linear layers repack theirs after loading,
    leaving the parameters empty, so the plain re-implementation reads this copy).
    """
    mimo = import_vllm_mimo_v2_omni()
    from vllm.transformers_utils.configs.mimo_v2_omni import Mimo_VLVisionConfig

    ensure_single_rank_tp_group()
    cfg = Mimo_VLVisionConfig(**TINY_TOWER)
    with vllm_config_context():
        tower = mimo.MiMoVisionTransformer(cfg, prefix="visual")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in tower.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "norm" in name or "ln_q" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(max(p.shape[-1], 1)))
    weights = {name: t.detach().clone() for name, t in tower.state_dict().items()}
    # What vLLM's loader does once weights are in (on CPU it prepares the linear layers' kernels).
    for module in tower.modules():
        quant_method = getattr(module, "quant_method", None)
        if quant_method is not None and hasattr(quant_method, "process_weights_after_loading"):
            quant_method.process_weights_after_loading(module)
    return tower.eval(), weights


def _rms_norm(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope_2d(grid_thw, merge, qk_channels):
    """cos/sin [tokens, qk/2]: rotary over half the head dim, half of it by row, half by column."""
    rotary_dim = qk_channels // 2
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    cos, sin = [], []
    for t, h, w in grid_thw:
        rows = torch.arange(h)[:, None].expand(h, w)
        cols = torch.arange(w)[None, :].expand(h, w)

        def merged(ids):  # token order: merge×merge blocks, row-major inside and across blocks
            return ids.reshape(h // merge, merge, w // merge, merge).permute(0, 2, 1, 3).flatten()

        ang = torch.cat([merged(rows)[:, None] * inv_freq, merged(cols)[:, None] * inv_freq], dim=1)
        cos.append(ang.cos().repeat(t, 1))
        sin.append(ang.sin().repeat(t, 1))
    return torch.cat(cos).float(), torch.cat(sin).float()


def _rotate(x, cos, sin):  # neox style over the whole head: halves (x1, x2)
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _column_order(grid_thw, merge):
    """Permutation of merge units that walks each image column by column (window type 1)."""
    order, offset = [], 0
    for t, h, w in grid_thw:
        units = torch.arange(t * (h // merge) * (w // merge)).reshape(t, h // merge, w // merge)
        order.append(units.transpose(1, 2).flatten() + offset)
        offset += units.numel()
    return torch.cat(order)


def plain_tower_hidden(weights: dict[str, torch.Tensor], pixels: torch.Tensor, grid_thw: list[list[int]],
                       use_sinks: bool = True) -> torch.Tensor:
    """The tiny tower's hidden states before the merger, recomputed in plain fp64 PyTorch.

    ``weights``: the copy :func:`build_tiny_tower` returns.
    """
    cfg = TINY_TOWER
    sd = {k: v.double() for k, v in weights.items()}
    merge, unit = cfg["spatial_merge_size"], cfg["spatial_merge_size"] ** 2
    heads, kv_heads, dqk = cfg["num_heads"], cfg["num_key_value_heads"], cfg["qk_channels"]
    x = pixels.double() @ sd["patch_embed.proj.weight"].reshape(cfg["hidden_size"], -1).T
    cos, sin = (c.double() for c in _rope_2d(grid_thw, merge, dqk))
    lens = [t * h * w for t, h, w in grid_thw]
    cu = torch.tensor([0] + lens).cumsum(0)
    col = _column_order(grid_thw, merge)

    def by_units(tensor, perm):
        return tensor.unflatten(0, (-1, unit))[perm].flatten(0, 1)

    layout = 0  # 0: row-major tokens, 1: column-major merge units
    for i in range(cfg["depth"]):
        kind = cfg["vit_window_attn_types"][i]
        want = 1 if kind == 1 else 0
        if want != layout:
            x = by_units(x, col if want == 1 else torch.argsort(col))
            layout = want
        c, s = (by_units(cos, col), by_units(sin, col)) if kind == 1 else (cos, sin)
        p = f"blocks.{i}."
        h = _rms_norm(x, sd[p + "norm1.weight"])
        qkv = h @ sd[p + "attn.qkv.weight"].T + sd[p + "attn.qkv.bias"]
        q, k, v = qkv.split([heads * dqk, kv_heads * dqk, kv_heads * cfg["kv_channels"]], dim=-1)
        q = _rotate(q.unflatten(-1, (heads, dqk)), c, s)
        k = _rotate(k.unflatten(-1, (kv_heads, dqk)), c, s)
        v = v.unflatten(-1, (kv_heads, cfg["kv_channels"]))
        full = i in cfg["fullatt_block_indexes"]
        sinks = sd.get(p + "attn.sinks") if use_sinks and not full else None
        window = 10 ** 9 if full else cfg["visual_token_window_size"]
        attn = dense_window_reference(q, k, v, cu, window, sinks, "key0", dqk ** -0.5)
        x = x + attn.flatten(1) @ sd[p + "attn.proj.weight"].T + sd[p + "attn.proj.bias"]
        h = _rms_norm(x, sd[p + "norm2.weight"])
        gate_up = h @ sd[p + "mlp.gate_up_proj.weight"].T + sd[p + "mlp.gate_up_proj.bias"]
        gate, up = gate_up.chunk(2, dim=-1)
        x = x + (F.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T + sd[p + "mlp.down_proj.bias"]
    if layout == 1:
        x = by_units(x, torch.argsort(col))
    return x
