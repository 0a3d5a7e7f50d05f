"""Prefill attention over packed variable-length sequences, with learnable sinks: the front door.

A drop-in superset of vLLM's ``vllm.v1.attention.ops.triton_prefill_attention.context_attention_fwd``
(same signature, same semantics, plus input checks and no device→host sync). Written for this
project; it imports neither vLLM nor anything but torch and Triton.

Semantics
---------
``context_attention_fwd(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal=True,
softmax_scale=None, sliding_window_q=None, sliding_window_k=None, sinks=None, sinks_bias_key0=False)``

- ``q`` [tokens, Hq, D]; ``k``, ``v`` [tokens, Hkv, D]; ``o`` [tokens, Hq, D] is written in place.
  Hq must be a multiple of Hkv (MHA, GQA, MQA): query head ``h`` reads KV head ``h // (Hq // Hkv)``.
- Sequence ``b`` owns rows ``b_start_loc[b] … b_start_loc[b] + b_seq_len[b] - 1``. Positions ``i``
  (query) and ``j`` (key) are counted from the start of their sequence; attention never crosses
  sequences. Rows of ``o`` that belong to no sequence are not written. Empty batches and zero-length
  sequences are valid.
- Key ``j`` is visible to query ``i`` when ``i - j <= sliding_window_q`` and ``j - i <=
  sliding_window_k`` (``None``, 0 or -1 leave that side unbounded; -1 is what vLLM's triton backend
  passes for "no window"), and, when ``is_causal``, ``j <= i``. Every query sees itself.
- Logits are ``q·k * softmax_scale`` (default ``D ** -0.5``, must be > 0); softmax and accumulation
  run in fp32.
- ``sinks`` [Hq] (fp32, bf16 or fp16), two meanings:

  * ``sinks_bias_key0=False`` — *null logit* (GPT-OSS, Granite SWA, DeepSeek V4, ...): the softmax
    denominator of every query of head ``h`` gets one extra term ``exp(sinks[h])`` that carries no
    value vector: ``o_i = Σ_j e^{s_ij} v_j / (e^{sinks[h]} + Σ_j e^{s_ij})``.
  * ``sinks_bias_key0=True`` — *key-0 bias* (MiMo-V2.5 vision encoder): ``sinks[h]`` is added to the
    scaled logit of key 0 of each sequence, for the queries that see key 0 (e.g. within the window),
    so it also reaches the numerator through ``v_0``. Queries that do not see key 0 are unaffected.

  Both match vLLM ≥ 0.28 (``sinks_bias_key0`` arrived with vLLM PR #49815); vLLM 0.27 has only the
  null logit.
- ``max_input_len`` (an int, or a one-element integer tensor as MiMo passes it) is only a hint and
  is never read from the device: an int or a CPU tensor sizes the launch grid (a bound that is too
  small costs time, never output), while a device tensor makes each program find its sequence and
  tile on the device. Either way a call costs no device→host sync and can be captured in a CUDA
  graph — except where it goes to upstream's op (below), which is upstream's own behaviour.
- fp16, bf16 and fp32 inputs (fp32 dots run in IEEE fp32, not tf32); head dims 1–256.

Bad input raises ``ValueError`` saying what is wrong. What cannot be checked without a sync (start
offsets and lengths against the number of rows) is clamped on the device instead: no kernel reads or
writes outside the tensors.

Which kernel runs
-----------------
Each kernel's ``plan`` says whether it takes a call; the first that does, in this order, runs it:

1. ``gluon_window_attention.WalkLaunch`` — sliding windows on an NVIDIA Hopper GPU (Gluon);
2. ``UpstreamLaunch`` — upstream vLLM's own op, where the vllm-sinks patch registered it
   (``use_upstream_op``) and the benchmark table says it is faster (``UPSTREAM_FASTER``);
3. ``prefill_attention_portable.PortableLaunch`` — the portable Triton kernel: every call.

A call signature (shapes, strides, dtypes, devices, arguments) is validated and planned once; later
calls with it go straight to the chosen launch.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

from vllm_sinks.v1.attention.ops.prefill_attention_portable import PortableLaunch
from vllm_sinks.v1.attention.ops.prefill_attention_problem import (
    Problem,
    call_key,
    host_length_bound,
    on_nvidia_gpu,
    validate,
)

if TYPE_CHECKING:
    from vllm_sinks.v1.attention.ops.gluon_window_attention import WalkLaunch

# ---- upstream's op, where it is the faster one ----------------------------------------------------

_UPSTREAM: list = []  # [upstream's context_attention_fwd], set by the prefill-op patch


def use_upstream_op(fn: Callable | None) -> None:
    """Let calls that upstream's op runs faster (``UPSTREAM_FASTER``) go to ``fn`` (upstream vLLM's
    ``context_attention_fwd``, which the prefill-op patch replaces); None: never."""
    _UPSTREAM[:] = [fn] if fn is not None else []
    _PLANS.clear()


#: Head dims at which our portable kernel beat upstream's op on full attention in the same run
#: (docs/benchmarks.md, "Full attention": SigLIP-like D 72 1.5–1.8 ×, InternViT-like D 128 1.05–1.1 ×).
OURS_FASTER_FULL_ATTENTION_HEAD_DIMS = (72, 128)


def UPSTREAM_FASTER(p: Problem) -> bool:
    """Calls that go to upstream's op: plain attention (no window, no sink) in fp16/bf16, except at
    the head dims where ours measured faster. Upstream's 128-row tiles beat ours at D 64 and 80
    (0.71–0.98 ×); shapes nobody measured go to upstream too, so the patch is never slower there.
    fp32 stays ours (upstream's dots run in TF32; ours in IEEE fp32)."""
    return p.full_attention and p.dtype == p.out_dtype and p.dtype.itemsize == 2 and \
        p.head_dim not in OURS_FASTER_FULL_ATTENTION_HEAD_DIMS


@dataclasses.dataclass(frozen=True)
class UpstreamLaunch:
    """A call handed to upstream's op unchanged (only calls without sinks: every supported
    release takes those, with the same semantics)."""

    name = "upstream"
    fn: Callable
    is_causal: bool
    softmax_scale: float | None
    sliding_window_q: int | None
    sliding_window_k: int | None

    @classmethod
    def plan(cls, p: Problem, args: tuple):
        if not _UPSTREAM or not UPSTREAM_FASTER(p):
            return None
        return cls(_UPSTREAM[0], *args[7:11])

    def __call__(self, q, k, v, o, b_start_loc, b_seq_len, sinks, max_input_len):
        self.fn(q, k, v, o, b_start_loc, b_seq_len, max_input_len, self.is_causal,
                self.softmax_scale, self.sliding_window_q, self.sliding_window_k)


# ---- the op ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Plan:
    """The launches that take one call signature, first choice first (a Hopper launch keeps the
    portable one as its fallback, for a variant that fails to compile)."""

    walk: WalkLaunch | None
    upstream: UpstreamLaunch | None
    portable: PortableLaunch

    @property
    def kernel(self) -> str:
        """Which kernel this call signature runs (for the benchmark's table)."""
        return (self.walk or self.upstream or self.portable).name

    def __call__(self, q, k, v, o, b_start_loc, b_seq_len, sinks, max_input_len):
        if self.walk is not None and \
                self.walk(q, k, v, o, b_start_loc, b_seq_len, sinks, host_length_bound(max_input_len)):
            return
        if self.upstream is not None:
            self.upstream(q, k, v, o, b_start_loc, b_seq_len, sinks, max_input_len)
            return
        self.portable(q, k, v, o, b_start_loc, b_seq_len, sinks, host_length_bound(max_input_len))


def plan(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal=True, softmax_scale=None,
         sliding_window_q=None, sliding_window_k=None, sinks=None, sinks_bias_key0=False) -> Plan:
    """Validate a call (``context_attention_fwd``'s arguments) and choose its kernel."""
    args = (q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal, softmax_scale,
            sliding_window_q, sliding_window_k, sinks, sinks_bias_key0)
    p = validate(*args)
    walk = None
    if on_nvidia_gpu(p.device):
        # Imported at the first call on an NVIDIA GPU, not with this module: Gluon and the kernel's
        # definitions are ~80 % of the op's import (benchmarks/plugin_load.py), and no other
        # platform can run them.
        from vllm_sinks.v1.attention.ops.gluon_window_attention import WalkLaunch

        walk = WalkLaunch.plan(p, q, k, v, o, b_start_loc, b_seq_len, sinks)
    return Plan(walk,
                UpstreamLaunch.plan(p, args),
                PortableLaunch.plan(p, q, k, v, o, b_start_loc, b_seq_len, sinks))


# Plans by call signature: a ViT calls the op with the same shapes in every layer, and the checks
# and planning cost ~20 µs of Python, more than the kernel on small inputs.
_PLANS: dict = {}
_PLANS_MAX = 512


def context_attention_fwd(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal=True,
                          softmax_scale=None, sliding_window_q=None, sliding_window_k=None,
                          sinks=None, sinks_bias_key0=False):
    """Attention over packed sequences with optional window and sinks; writes ``o`` in place.

    See the module docstring for the semantics. Raises ``ValueError`` on bad input.
    """
    key = call_key(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal, softmax_scale,
                   sliding_window_q, sliding_window_k, sinks, sinks_bias_key0)
    chosen = _PLANS.get(key) if key is not None else None
    if chosen is None:
        chosen = plan(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal, softmax_scale,
                      sliding_window_q, sliding_window_k, sinks, sinks_bias_key0)
        if key is not None:
            if len(_PLANS) >= _PLANS_MAX:
                _PLANS.clear()
            _PLANS[key] = chosen
    chosen(q, k, v, o, b_start_loc, b_seq_len, sinks, max_input_len)
