"""MiMo-V2-Omni (MiMo-V2.5) vision encoder: window attention that applies its learnable sinks.

Fork of the window-attention piece of upstream ``vllm/model_executor/models/mimo_v2_omni.py``
(``MiMoVisionAttention._forward_window_attn``). Imports without vLLM: the GPU benchmark and the GPU
test call :func:`window_attention_with_sinks` directly; the patch
(``vllm_sinks.patches.mimo_vision_sinks``) binds :func:`make_forward_window_attn` onto vLLM's class.

The vision tower has ``depth`` blocks; the window blocks (all but ``fullatt_block_indexes``) carry a
per-head ``sinks`` parameter and attend to ``|i - j| <= visual_token_window_size`` inside each image.
Two readings of that sink exist (see docs/mimo-sink-semantics.md for the evidence on both sides):

* ``key0`` (default): ``sinks[h]`` is added to the logit of each sequence's *first key* (key 0), so
  it re-weights a real token. Only queries whose window reaches key 0 feel it.
* ``null``: ``sinks[h]`` is an extra logit with no value (GPT-OSS style): it only enlarges the
  softmax denominator, for every query.

Chosen with ``VLLM_SINKS_MIMO_SINK_SEMANTICS`` = ``key0`` | ``null``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from vllm_sinks.env import MIMO_SINK_SEMANTICS

#: Env var selecting how the vision sinks enter the softmax.
SEMANTICS_ENV = MIMO_SINK_SEMANTICS.name
KEY0 = "key0"
NULL = "null"
SINK_SEMANTICS = (KEY0, NULL)
DEFAULT_SEMANTICS = KEY0

#: The op we call: ``context_attention_fwd(q, k, v, o, b_start_loc, b_seq_len, max_input_len, ...)``.
PrefillOp = Callable[..., Any]


def parse_sink_semantics(raw: str | None) -> str:
    """``key0`` / ``null`` (case and surrounding space ignored; empty = default). Anything else raises
    ``BadSetting`` (a ValueError), worded as for every vllm-sinks env var (``vllm_sinks.env``)."""
    return MIMO_SINK_SEMANTICS.read({} if raw is None else {SEMANTICS_ENV: raw})


def sink_semantics_from_env(environ: Mapping[str, str] | None = None) -> str:
    return MIMO_SINK_SEMANTICS.read(environ)


def describe_semantics(semantics: str) -> str:
    """One phrase for the report line."""
    if semantics == KEY0:
        return f"sinks as key-0 logit bias ({SEMANTICS_ENV}={KEY0})"
    return f"sinks as null logit ({SEMANTICS_ENV}={NULL}, opt-in)"


_OPS: list = []  # [our op's module, its call checks' module], at the first call


def _our_op_module():
    # Lazy: importing Triton costs time and the op module is not needed to parse settings.
    if not _OPS:
        from vllm_sinks.v1.attention.ops import prefill_attention_problem, triton_prefill_attention

        _OPS[:] = [triton_prefill_attention, prefill_attention_problem]
    return _OPS[0]


def _our_prefill_op() -> PrefillOp:
    return _our_op_module().context_attention_fwd


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                  window: int, sinks: torch.Tensor | None) -> None:
    # Shapes, dtypes and devices only: looking at cu_seqlens' *values* would cost a device->host sync.
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [tokens, heads, head_dim]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"q, k, v token counts differ: {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v head counts differ: {k.shape[1]} vs {v.shape[1]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k head dims differ: {q.shape[2]} vs {k.shape[2]}")
    _check_cu_seqlens(cu_seqlens, q.device)
    # The op reads a window of 0 as "no window" (full attention): refuse it rather than widen it.
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int (tokens each side); got {window!r}")
    if sinks is not None:
        if sinks.dim() != 1 or sinks.shape[0] != q.shape[1]:
            raise ValueError(f"sinks must be [query heads] = [{q.shape[1]}]; got {tuple(sinks.shape)}")
        if sinks.device != q.device:
            raise ValueError(f"sinks are on {sinks.device}, q on {q.device}")


def _check_cu_seqlens(cu_seqlens: torch.Tensor, device: torch.device) -> None:
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
            or cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [num_seqs + 1]; got "
                         f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)} "
                         f"{tuple(getattr(cu_seqlens, 'shape', ()))}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device}, q on {device}")


_KEY0_OF = {KEY0: True, NULL: False}
#: First field of the wrapper's call keys in the op's plan cache (the op's own keys start with a
#: shape: the two never collide).
_WRAPPER_KEY = "window_attention_with_sinks"


def window_attention_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | torch.Tensor,
    window: int,
    sinks: torch.Tensor | None,
    semantics: str = DEFAULT_SEMANTICS,
    *,
    softmax_scale: float | None = None,
    op: PrefillOp | None = None,
) -> torch.Tensor:
    """Bidirectional window attention over packed sequences, with per-head sinks.

    q [T, Hq, D], k/v [T, Hkv, D] (GQA: Hq a multiple of Hkv), ``cu_seqlens`` [S + 1] int,
    ``max_seqlen`` an int or a 0-d tensor on q's device (passed on as is: no device->host sync) or on
    the host (read there). Query i of a
    sequence sees keys j of the same sequence with ``|i - j| <= window``. ``sinks`` [Hq] are this
    rank's heads. ``op`` defaults to vllm-sinks' Triton prefill op. Returns [T, Hq, Dv].

    With our op, a call signature seen before costs its key (a flat tuple of the tensors' metadata
    and the other arguments), a fresh output and the C launch its kernel took before
    (``Plan.launch_seen``): the checks run on its first call (here and in the op's ``plan``), the
    kernels read ``cu_seqlens`` as is (no offsets or lengths derived from it), and the plan is
    cached by this function's own key (``_window_call``).
    """
    key0 = _KEY0_OF.get(semantics) if isinstance(semantics, str) else None
    if key0 is None:
        key0 = parse_sink_semantics(semantics) == KEY0
    if op is None:
        op = _our_prefill_op()
    mod = _OPS[0] if _OPS else _our_op_module()
    if op is not mod.context_attention_fwd:
        return _through(op, q, k, v, cu_seqlens, max_seqlen, window, sinks, key0, softmax_scale)
    return _window_call(q, k, v, cu_seqlens, max_seqlen, window, sinks, key0, softmax_scale)


def _window_call(q, k, v, cu_seqlens, max_seqlen, window, sinks, key0: bool, softmax_scale):
    """``window_attention_with_sinks`` through our op (imported: ``_OPS``), arguments positional
    (the patched layer calls this directly: each keyword and frame is ~0.1–0.3 µs of a layer's
    ~15). ``cu_seqlens`` goes to the kernels as is (they read its cumulative offsets:
    ``Problem.cu_seqlens``), so nothing is derived from it on the host and nothing derived is
    cached: a CUDA graph replays whatever offsets it holds then, and inference-mode tensors (which
    keep no version counter) need no special case. A signature seen before: its plan by key, the
    bound read, a fresh output and the C launch (``Plan.launch_seen``)."""
    mod = _OPS[0]
    key = wrapper_key(q, k, v, cu_seqlens, max_seqlen, window, sinks, key0, softmax_scale)
    try:
        chosen = None if key is None else mod._PLANS.get(key)
    except TypeError:  # unhashable arguments: the checks say what
        key = chosen = None
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if chosen is None:
        _check_inputs(q, k, v, cu_seqlens, window, sinks)
        max_seqlen = _bound_on_host(max_seqlen, q.device)
        chosen = mod.remember(key, mod.plan(q, k, v, out, cu_seqlens, cu_seqlens, max_seqlen, False,
                                            softmax_scale, window, window, sinks, key0,
                                            cu_seqlens=True))
    elif chosen._ready:
        cu = cu_seqlens.data_ptr()
        if chosen.launch_seen(q, k, v, out, sinks, _OPS[1].host_length_bound(max_seqlen), cu, cu):
            return out
    chosen(q, k, v, out, cu_seqlens, cu_seqlens, sinks, max_seqlen)
    return out


def wrapper_key(q, k, v, cu_seqlens, max_seqlen, window, sinks, key0: bool, softmax_scale):
    """The wrapper's call signature in the op's plan cache (what the op's key would hold: o derives
    from q, and cu_seqlens stands for the offsets), or None for arguments that are not tensors
    (the checks then say what is wrong)."""
    try:
        return (_WRAPPER_KEY, q.shape, q.stride(), q.dtype, q.get_device(), k.shape, k.stride(),
                k.dtype, k.get_device(), v.shape, v.stride(), v.dtype, v.get_device(),
                cu_seqlens.shape, cu_seqlens.stride(), cu_seqlens.dtype, cu_seqlens.get_device(),
                None if sinks is None else (sinks.shape, sinks.stride(), sinks.dtype,
                                            sinks.get_device()),
                _OPS[1].bound_key(max_seqlen), type(window), window, key0, softmax_scale)
    except (AttributeError, TypeError):  # not tensors, an incomparable bound
        return None


def _bound_on_host(max_seqlen, device: torch.device):
    """A tensor bound on q's device or the host (read there by the op, no sync); another device's
    is refused."""
    if isinstance(max_seqlen, torch.Tensor) and max_seqlen.device != device and \
            max_seqlen.device.type != "cpu":
        raise ValueError(f"max_seqlen is on {max_seqlen.device}, q on {device}")
    return max_seqlen


def _through(op, q, k, v, cu_seqlens, max_seqlen, window, sinks, key0, softmax_scale):
    """The call through another op (upstream's, a test's stand-in): every check on every call."""
    _check_inputs(q, k, v, cu_seqlens, window, sinks)
    if isinstance(max_seqlen, torch.Tensor) and max_seqlen.device != q.device:
        _bound_on_host(max_seqlen, q.device)
        # Other ops want every tensor argument on q's device: read a host bound here (no sync).
        max_seqlen = int(max_seqlen)
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
    op(
        q,
        k,
        v,
        out,
        b_start_loc=cu_seqlens[:-1],
        b_seq_len=cu_seqlens[1:] - cu_seqlens[:-1],
        max_input_len=max_seqlen,
        is_causal=False,
        softmax_scale=softmax_scale,
        sliding_window_q=window,
        sliding_window_k=window,
        sinks=sinks,
        sinks_bias_key0=key0,
    )
    return out


# ---- the head partition a rank's vision attention computes ----------------------------------------


def vit_partition_rank(attn: Any) -> int:
    """Index of the head partition this rank's ``MiMoVisionAttention`` computes.

    Releases before ``vllm_sinks.patches.DATA_PARALLEL_VIT_RANK_SINCE`` store the *global*
    tensor-parallel rank in ``attn.tp_rank`` even when the ViT runs data-parallel
    (``is_vit_use_data_parallel()``: ``attn.tp_size == 1``, every rank holds all heads); later ones
    store 0 there. The QKV projection knows which shard it really computes (``disable_tp`` sets its
    ``tp_rank`` to 0), so we ask it first; the fallback reads the same thing off ``tp_size``: right
    on either.
    """
    qkv = getattr(attn, "qkv", None)
    rank = getattr(qkv, "tp_rank", None)
    if rank is None:
        rank = attn.tp_rank if attn.tp_size > 1 else 0
    return int(rank)


def sinks_for_partition(sinks: torch.Tensor, heads_per_partition: int, partition_rank: int) -> torch.Tensor:
    """This partition's slice of the full per-head ``sinks`` (already-local sinks pass through)."""
    if sinks.dim() != 1:
        raise ValueError(f"sinks must be 1-D [heads]; got {tuple(sinks.shape)}")
    if sinks.shape[0] == heads_per_partition:
        # Exactly this rank's heads: one partition (single rank or data-parallel ViT, where the full
        # parameter *is* the partition), or a loader that already sharded them.
        return sinks
    start = partition_rank * heads_per_partition
    if heads_per_partition <= 0 or start + heads_per_partition > sinks.shape[0]:
        raise ValueError(f"head partition {partition_rank} × {heads_per_partition} heads is outside the "
                         f"{sinks.shape[0]} sinks")
    return sinks[start:start + heads_per_partition]


def attention_sinks_for_rank(attn: Any) -> torch.Tensor | None:
    """The sinks for the heads ``attn`` computes on this rank (None for blocks without sinks)."""
    # nn.Module's attribute lookup for a parameter costs ~0.4 µs (its __getattr__ runs after the
    # instance dict misses): its parameters' dict first
    params = getattr(attn, "_parameters", None)
    sinks = params.get("sinks") if type(params) is dict else None
    if sinks is None:
        sinks = getattr(attn, "sinks", None)
        if sinks is None:
            return None
    heads = attn.num_heads_per_partition
    if sinks.dim() == 1 and sinks.shape[0] == heads:  # this rank's heads already (per call: cheap)
        return sinks
    return sinks_for_partition(sinks, heads, vit_partition_rank(attn))


def make_forward_window_attn(semantics: str, resolve_op: Callable[[], PrefillOp] | None = None):
    """A drop-in ``MiMoVisionAttention._forward_window_attn`` (same signature: upstream's tests call it).

    ``resolve_op`` is called per call (so an op patched in later is the one used); None = ours.
    """
    semantics = parse_sink_semantics(semantics)

    key0 = semantics == KEY0

    def _forward_window_attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             cu_seqlens: torch.Tensor, max_seqlen: torch.Tensor) -> torch.Tensor:
        """Window attention with this rank's sinks, through the prefill op (vllm-sinks)."""
        op = resolve_op() if resolve_op is not None else None
        if _OPS and (op is None or op is _OPS[0].context_attention_fwd):  # ours, imported
            return _window_call(q, k, v, cu_seqlens, max_seqlen, self.visual_token_window_size,
                                attention_sinks_for_rank(self), key0, self.scale)
        return window_attention_with_sinks(
            q, k, v, cu_seqlens, max_seqlen,
            window=self.visual_token_window_size,
            sinks=attention_sinks_for_rank(self),
            semantics=semantics,
            softmax_scale=self.scale,
            op=op,
        )

    _forward_window_attn.sink_semantics = semantics  # apply() reads it back for the report line
    return _forward_window_attn
