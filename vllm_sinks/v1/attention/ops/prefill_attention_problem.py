"""What every kernel of the prefill op shares: the validated call (``Problem``), its constants, the
clamp of a sequence's offsets, and the platform checks.

The op's semantics are in ``triton_prefill_attention``'s docstring (the front door). This module
imports torch and Triton only; no vLLM. Everything that both the portable Triton kernel
(``prefill_attention_portable``) and the Hopper kernel (``gluon_window_attention``) need is written
here once: sink modes, the key block, grid limits, interpreter detection, the offset clamp.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from vllm_sinks.v1.attention.ops.prefill_attention_reference import normalize_window

# Sink modes (a kernel constexpr): none, the null logit (GPT-OSS), a bias on key 0 (MiMo vision).
SINKS_NONE, SINKS_NULL_LOGIT, SINKS_KEY0_BIAS = 0, 1, 2
#: Keys per step of a banded key loop, and per ring slot of the Hopper kernel.
BLOCK_KEYS = 16
#: CUDA's limit on grid axes 1 and 2 (axis 0 takes 2**31 - 1).
MAX_GRID_YZ = 65535
#: Softmax runs in base 2 in both kernels: exp(x) = exp2(x * LOG2E).
LOG2E = 1.4426950408889634
#: Triton's interpreter (tests on the CPU). Read once, at import, as ``@triton.jit`` does.
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"

# The same constants for jitted code (Triton reads only constexpr globals).
NONE_C = tl.constexpr(SINKS_NONE)
NULL_LOGIT_C = tl.constexpr(SINKS_NULL_LOGIT)
KEY0_BIAS_C = tl.constexpr(SINKS_KEY0_BIAS)
BLOCK_KEYS_C = tl.constexpr(BLOCK_KEYS)
LOG2E_C = tl.constexpr(LOG2E)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def load_sequence(StartLoc, SeqLen, seq, total_tokens, stride_start, stride_len):
    """Start row (int64) and length (int32) of sequence ``seq``, clamped into the buffer.

    Offsets cannot be checked on the host without a device sync, so every kernel clamps them here
    instead: a sequence that starts before the buffer is empty, one that runs past it is cut, and
    no program reads or writes outside the tensors. (Plain scalar code: Gluon kernels call it too.)
    """
    seq_start = tl.load(StartLoc + seq * stride_start).to(tl.int64)
    seq_len = tl.load(SeqLen + seq * stride_len).to(tl.int64)
    return _clamp_sequence(seq_start, seq_len, total_tokens)


@triton.jit
def load_sequence_cu(CuSeqlens, seq, total_tokens, stride_cu):
    """``load_sequence`` for cumulative offsets (``cu_seqlens``, [sequences + 1]): sequence ``seq``
    is rows ``cu[seq] … cu[seq + 1] - 1``. The kernels read them so when the MiMo wrapper passes
    its ``cu_seqlens`` as is (``Problem.cu_seqlens``): no lengths to derive on the host, so nothing
    derived to cache, and a CUDA graph replays whatever offsets the tensor holds then."""
    seq_start = tl.load(CuSeqlens + seq * stride_cu).to(tl.int64)
    seq_len = tl.load(CuSeqlens + (seq + 1) * stride_cu).to(tl.int64) - seq_start
    return _clamp_sequence(seq_start, seq_len, total_tokens)


@triton.jit
def _clamp_sequence(seq_start, seq_len, total_tokens):
    seq_len = tl.minimum(seq_len, total_tokens - seq_start)
    seq_len = tl.where(seq_start < 0, 0, tl.maximum(seq_len, 0)).to(tl.int32)
    return seq_start, seq_len


def on_nvidia_gpu(device: torch.device) -> bool:
    """A CUDA device of an NVIDIA GPU (ROCm builds of PyTorch also say "cuda")."""
    return device.type == "cuda" and torch.version.hip is None and not INTERPRETING


def launch_options(device: torch.device, num_warps: int, num_stages: int | None = None,
                   maxnreg: int | None = None) -> dict:
    """Triton launch options; the CUDA-only ones only on an NVIDIA GPU: ``maxnreg``, and FMA
    contraction asked for by name (``enable_fp_fusion``). Triton 3.7–3.9 contract by default, and
    the kernels were tuned and their error measured so; Triton 3.9 warns once per process that
    the default turns to "off" in 3.10 (``TRITON_DEFAULT_FP_FUSION``), which would change the
    kernels' code and numerics under a user's feet."""
    options = dict(num_warps=num_warps)
    if num_stages is not None:
        options["num_stages"] = num_stages
    if on_nvidia_gpu(device):
        options["enable_fp_fusion"] = True
        if maxnreg:
            options["maxnreg"] = maxnreg
    return options


@dataclasses.dataclass(frozen=True)
class Problem:
    """A validated call, reduced to what the kernels need."""

    tokens: int
    num_seqs: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    out_dtype: torch.dtype
    device: torch.device
    is_causal: bool
    window_q: int  # 0: unbounded
    window_k: int
    sink_mode: int
    scale: float
    # max_input_len is a host int or CPU tensor (readable without a sync: it can size the grid)
    host_bound: bool
    # b_start_loc and b_seq_len are one cu_seqlens tensor [num_seqs + 1] of cumulative offsets (the
    # MiMo wrapper's internal call, ``load_sequence_cu``); the op's own callers never pass this
    cu_seqlens: bool = False

    @property
    def log2_scale(self) -> float:
        return self.scale * LOG2E

    @property
    def queries_per_kv(self) -> int:
        return self.q_heads // self.kv_heads

    @property
    def banded(self) -> bool:
        """Both sides of the band bounded (a window, or a causal window): few keys per query."""
        return self.window_q > 0 and (self.window_k > 0 or self.is_causal)

    @property
    def full_attention(self) -> bool:
        """No window on either side and no sink: plain (causal or not) attention."""
        return self.window_q == 0 and self.window_k == 0 and self.sink_mode == SINKS_NONE

    @property
    def empty(self) -> bool:
        return self.tokens == 0 or self.num_seqs == 0


def stride_args(q, k, v, o, sinks, b_start_loc, b_seq_len) -> tuple:
    """The strides both kernels take, in their order (the last dim is unit-stride: validated)."""
    return (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            o.stride(0), o.stride(1), sinks.stride(0) if sinks is not None else 0,
            b_start_loc.stride(0), b_seq_len.stride(0))


def host_length_bound(max_input_len) -> int | None:
    """``max_input_len`` as a host int when reading it costs no device sync (an int, or a CPU
    tensor as MiMo passes it), else None (a device tensor: the kernels find each program's
    sequence on the device). A CPU tensor is read on every call (~0.2 µs): nothing keyed by the
    object could tell an in-place write apart, since vLLM runs models in inference mode, whose
    tensors keep no version counter."""
    if isinstance(max_input_len, torch.Tensor):
        return max_input_len.item() if max_input_len.is_cpu else None
    return int(max_input_len)


def bound_key(max_input_len):
    """What of ``max_input_len`` a call signature holds: whether it is an int, a host tensor or a
    device tensor, not its value (launches keep their grids by bound)."""
    if isinstance(max_input_len, torch.Tensor):
        return (max_input_len.numel(), max_input_len.dtype, max_input_len.get_device())
    return (type(max_input_len), max_input_len >= 0)


def call_key(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal, softmax_scale,
             sliding_window_q, sliding_window_k, sinks, sinks_bias_key0):
    """Everything ``validate`` and the kernels' plans look at, as one flat tuple, or None for an
    argument a valid call does not pass (``validate`` then says what is wrong). Whether the length
    bound is on the host is part of it (that picks the kernel); its value is not (launches keep
    their grids by bound). Built on every call: ~25 attribute reads, nothing more."""
    try:
        mil = bound_key(max_input_len)
        if sinks is None:
            sink = None
        else:
            sink = (sinks.shape, sinks.stride(), sinks.dtype, sinks.get_device(), sinks_bias_key0)
        return (q.shape, q.stride(), q.dtype, q.get_device(), k.shape, k.stride(), k.dtype,
                k.get_device(), v.shape, v.stride(), v.dtype, v.get_device(), o.shape, o.stride(),
                o.dtype, o.get_device(), b_start_loc.shape, b_start_loc.stride(), b_start_loc.dtype,
                b_start_loc.get_device(), b_seq_len.shape, b_seq_len.stride(), b_seq_len.dtype,
                b_seq_len.get_device(), sink, mil, is_causal, softmax_scale, sliding_window_q,
                sliding_window_k, sinks_bias_key0)
    except Exception:  # noqa: BLE001 - not a tensor, incomparable value...: validate says what
        return None


def _check_tensor(name, t, ndim):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")


def _check_shapes(q, k, v, o):
    for name, t in (("q", q), ("k", k), ("v", v), ("o", o)):
        _check_tensor(name, t, 3)
    tokens, hq, d = q.shape
    if k.shape[0] != tokens or v.shape[0] != tokens or o.shape[0] != tokens:
        raise ValueError(f"q, k, v, o must have the same number of tokens; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}, o {tuple(o.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[2] != d:
        raise ValueError(f"q and k must have the same head dim; got {d} and {k.shape[2]}")
    if tuple(o.shape) != (tokens, hq, d):
        raise ValueError(f"o must be [{tokens}, {hq}, {d}] like q, got {tuple(o.shape)}")
    if d < 1 or d > 256:
        raise ValueError(f"head dim must be in 1..256, got {d}")
    hkv = k.shape[1]
    if hkv < 1 or hq < 1 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a positive multiple of KV heads ({hkv})")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if o.dtype not in FLOAT_DTYPES:
        raise ValueError(f"o must be float16, bfloat16 or float32, got {o.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v), ("o", o)):
        if t.numel() and t.stride(2) != 1:
            raise ValueError(f"{name} must have a unit stride in its last (head_dim) dimension, "
                             f"got strides {t.stride()}")
    return tokens, hq, hkv, d


def _check_lengths(b_start_loc, b_seq_len, max_input_len, cu_seqlens: bool = False) -> int:
    """The number of sequences (checks of the offsets, lengths and bound)."""
    for name, t in (("b_start_loc", b_start_loc), ("b_seq_len", b_seq_len)):
        _check_tensor(name, t, 1)
        if t.dtype not in INDEX_DTYPES:
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if cu_seqlens:
        if b_start_loc is not b_seq_len or b_seq_len.shape[0] < 1:
            raise ValueError("cumulative offsets: b_start_loc and b_seq_len must be one cu_seqlens "
                             "tensor [num_seqs + 1]")
    elif b_start_loc.shape != b_seq_len.shape:
        raise ValueError(f"b_start_loc and b_seq_len must have the same length; got "
                         f"{b_start_loc.shape[0]} and {b_seq_len.shape[0]}")
    if isinstance(max_input_len, torch.Tensor):
        if max_input_len.numel() != 1 or max_input_len.dtype.is_floating_point or \
                max_input_len.dtype == torch.bool:
            raise ValueError(f"max_input_len must be an int or a one-element integer tensor, got a "
                             f"{max_input_len.dtype} tensor of shape {tuple(max_input_len.shape)}")
    elif isinstance(max_input_len, bool) or not isinstance(max_input_len, int):
        raise ValueError(f"max_input_len must be an int or a 0-d integer tensor, got "
                         f"{type(max_input_len).__name__}")
    elif max_input_len < 0:
        raise ValueError(f"max_input_len must be >= 0, got {max_input_len}")
    return b_seq_len.shape[0] - 1 if cu_seqlens else b_seq_len.shape[0]


def _check_scale(softmax_scale, d) -> float:
    if softmax_scale is None:
        return d ** -0.5
    if isinstance(softmax_scale, (int, float)) and not isinstance(softmax_scale, bool):
        scale = float(softmax_scale)
        if not (0.0 < scale < float("inf")):
            raise ValueError(f"softmax_scale must be positive and finite, got {softmax_scale}")
        return scale
    raise ValueError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")


def _check_sinks(sinks, sinks_bias_key0, hq) -> int:
    if not isinstance(sinks_bias_key0, bool):
        raise ValueError(f"sinks_bias_key0 must be a bool, got {type(sinks_bias_key0).__name__}")
    if sinks is None:
        return SINKS_NONE
    _check_tensor("sinks", sinks, 1)
    if sinks.shape[0] != hq:
        raise ValueError(f"sinks must have one value per query head ({hq}), got {sinks.shape[0]}")
    if sinks.dtype not in FLOAT_DTYPES:
        raise ValueError(f"sinks must be float32, bfloat16 or float16, got {sinks.dtype}")
    return SINKS_KEY0_BIAS if sinks_bias_key0 else SINKS_NULL_LOGIT


def validate(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal, softmax_scale,
             sliding_window_q, sliding_window_k, sinks, sinks_bias_key0,
             cu_seqlens: bool = False) -> Problem:
    """Every check of a call, on tensor metadata only (no device→host sync); ValueError says what
    is wrong. ``cu_seqlens``: b_start_loc and b_seq_len are one tensor of cumulative offsets."""
    tokens, hq, hkv, d = _check_shapes(q, k, v, o)
    num_seqs = _check_lengths(b_start_loc, b_seq_len, max_input_len, cu_seqlens)
    wq = normalize_window(sliding_window_q, "sliding_window_q")
    wk = normalize_window(sliding_window_k, "sliding_window_k")
    scale = _check_scale(softmax_scale, d)
    sink_mode = _check_sinks(sinks, sinks_bias_key0, hq)
    # max_input_len is never read on the device, so it may live anywhere: MiMo's vision tower
    # passes a host tensor (its grid sizes stay on the CPU) while q is on the GPU.
    device = q.device
    for name, t in (("k", k), ("v", v), ("o", o), ("b_start_loc", b_start_loc),
                    ("b_seq_len", b_seq_len), ("sinks", sinks)):
        if t is not None and t.device != device:
            raise ValueError(f"all tensors must be on one device: q is on {device}, {name} on {t.device}")
    if device.type == "cpu" and not INTERPRETING:
        raise ValueError("tensors are on the CPU: the Triton kernel needs a GPU "
                         "(or TRITON_INTERPRET=1 for the interpreter)")
    return Problem(tokens=tokens, num_seqs=num_seqs, q_heads=hq, kv_heads=hkv, head_dim=d,
                   dtype=q.dtype, out_dtype=o.dtype, device=device, is_causal=bool(is_causal),
                   window_q=wq, window_k=wk, sink_mode=sink_mode, scale=scale,
                   host_bound=host_length_bound(max_input_len) is not None,
                   cu_seqlens=cu_seqlens)
