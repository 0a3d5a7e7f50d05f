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
  graph — except where it goes to upstream's op (below), which is upstream's own behaviour, and
  the first call of a signature that upstream's op may take, where both ops are timed (once per
  process; never inside graph capture).
- fp16, bf16 and fp32 inputs (fp32 dots run in IEEE fp32, not tf32); head dims 1–256.

Bad input raises ``ValueError`` saying what is wrong. What cannot be checked without a sync (start
offsets and lengths against the number of rows) is clamped on the device instead: no kernel reads or
writes outside the tensors.

Which kernel runs
-----------------
Each kernel's ``plan`` says whether it takes a call; the first that does, in this order, runs it:

1. ``gluon_window_attention.WalkLaunch`` — sliding windows on an NVIDIA Hopper GPU (Gluon);
2. ``upstream_launch.UpstreamLaunch`` — upstream vLLM's own op, where the vllm-sinks patch
   registered it (``use_upstream_op``), for the calls it can take (``upstream_may_take``: full
   attention) when it measured faster than ours on this call signature (``measured_choice``: both
   timed once, the first time the signature is seen; upstream unless ours is faster by a margin).
   Its first call of a signature and bound is recorded; later ones launch upstream's kernel again
   with the same grid and arguments through its C launch, without upstream's Python
   (``upstream_launch.UpstreamRoute``: same kernel, same output, ~30–45 µs less CPU a call on
   the H200 machine);
3. ``prefill_attention_portable.PortableLaunch`` — the portable Triton kernel: every call.

A call signature (shapes, strides, dtypes, devices, arguments) is validated and planned once; later
calls with it go straight to the C launch its kernel took before with the same length bound
(``Plan.launch_seen``), recognised by their arguments that are not tensors and one C check of
their tensors' metadata (``signature_cache``; the plan cache's key, ``call_key``, is built on a
miss only). Calls that upstream's op measured faster on (int bound) are recognised
the same way (``route_key``) and handed to their route before any of ours runs. A call whose whole
signature was not validated before never takes either path.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

import torch

from vllm_sinks.v1.attention.ops import kernel_launcher, measured_choice, signature_cache
from vllm_sinks.v1.attention.ops.prefill_attention_portable import PortableLaunch
from vllm_sinks.v1.attention.ops.prefill_attention_problem import (
    Problem,
    call_key,
    host_length_bound,
    on_nvidia_gpu,
    validate,
)
from vllm_sinks.v1.attention.ops.upstream_launch import UpstreamLaunch

if TYPE_CHECKING:
    from vllm_sinks.v1.attention.ops.gluon_window_attention import WalkLaunch

# ---- upstream's op, where it measured faster ----------------------------------------------------

_UPSTREAM: list = []  # [upstream's context_attention_fwd], set by the prefill-op patch


def use_upstream_op(fn: Callable | None) -> None:
    """Let calls that upstream's op can take (``upstream_may_take``) go to ``fn`` (upstream vLLM's
    ``context_attention_fwd``, which the prefill-op patch replaces) where it measures faster; None:
    never."""
    _UPSTREAM[:] = [fn] if fn is not None else []
    _PLANS.clear()
    _SEEN.clear()
    _ROUTES.clear()


def upstream_may_take(p: Problem) -> bool:
    """Calls upstream's op runs with our semantics on every supported release: plain attention (no
    window, no sink), output in the input dtype. Which of the two runs such a call is measured
    (``measured_choice``), per call signature. (In fp32 upstream's dots run in TF32, ours in IEEE
    fp32: where upstream is chosen, the call gets exactly what vLLM without the plugin gives.)"""
    return p.full_attention and p.dtype == p.out_dtype and not p.empty and not p.cu_seqlens


def _upstream_launch(p: Problem, args: tuple) -> UpstreamLaunch | None:
    """Upstream's op as a plan's launch, where it is registered and may take the call."""
    if not _UPSTREAM or not upstream_may_take(p):
        return None
    return UpstreamLaunch(_UPSTREAM[0], *args[7:11])


# ---- the op ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Plan:
    """The launches that take one call signature, first choice first (a Hopper launch keeps the
    portable one as its fallback, for a variant that fails to compile). ``measured``: False for a
    choice made without timing (in graph capture or tracing), which is not cached."""

    walk: WalkLaunch | None
    upstream: UpstreamLaunch | None
    portable: PortableLaunch
    measured: bool = True
    #: upstream's time / ours, where the choice was timed (for the benchmark's table)
    speedup: float | None = None
    #: length bound -> the direct C launch of the kernel that ran this signature with it
    #: (``DirectLauncher.ready``), for ``launch_seen``; filled by the calls that launch
    _ready: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def kernel(self) -> str:
        """Which kernel this call signature runs (for the benchmark's table)."""
        return (self.walk or self.upstream or self.portable).name

    def __call__(self, q, k, v, o, b_start_loc, b_seq_len, sinks, max_input_len):
        if self.upstream is not None:  # never beside a walk: ``plan`` builds one or the other
            self.upstream(q, k, v, o, b_start_loc, b_seq_len, sinks, max_input_len)
            return
        hint = host_length_bound(max_input_len)
        launch = self.walk
        if launch is None or not launch(q, k, v, o, b_start_loc, b_seq_len, sinks, hint):
            launch = self.portable
            launch(q, k, v, o, b_start_loc, b_seq_len, sinks, hint)
        self._keep_ready(launch, hint)

    def _keep_ready(self, launch, hint) -> None:
        if hint not in self._ready:
            ready = launch.ready(hint)
            if ready is not None:
                if len(self._ready) >= 64:
                    self._ready.clear()
                self._ready[hint] = ready

    def launch_seen(self, q, k, v, o, sinks, hint, start_ptr: int, len_ptr: int) -> bool:
        """Launch a call of this validated signature straight through the C launch its kernel
        took before with this length bound (``host_length_bound``), given the start offsets' and
        lengths' addresses; False (nothing launched) where there is none yet, a pointer is not
        16-byte aligned (Triton compiled for aligned ones) or a launch hook is set: then the call
        takes ``__call__``. A MiMo layer's CPU is mostly the frames between here and the C
        launch otherwise (benchmarks/kernels/host_cost.py, "taken apart")."""
        ready = self._ready.get(hint)
        if ready is None:
            return False
        a, b, c, d = q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr()
        e = a if sinks is None else sinks.data_ptr()
        if (a | b | c | d | e | start_ptr | len_ptr) & 15 or kernel_launcher.hooks_set():
            return False
        launch, get_stream, get_device, gx, gy, gz, head, rest = ready
        launch(gx, gy, gz, get_stream(get_device()), *head, (a, b, c, d, e, start_ptr, len_ptr, *rest))
        return True


def plan(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal=True, softmax_scale=None,
         sliding_window_q=None, sliding_window_k=None, sinks=None, sinks_bias_key0=False,
         cu_seqlens: bool = False) -> Plan:
    """Validate a call (``context_attention_fwd``'s arguments) and choose its kernel. Where
    upstream's op may take the call too, both run on these tensors (``o`` is written) and the
    faster is chosen (``measured_choice``). ``cu_seqlens`` (the MiMo wrapper's calls only):
    b_start_loc and b_seq_len are one tensor of cumulative offsets [num_seqs + 1], which the
    kernels read as is (``Problem.cu_seqlens``); the launches then take it in both places."""
    args = (q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal, softmax_scale,
            sliding_window_q, sliding_window_k, sinks, sinks_bias_key0)
    p = validate(*args, cu_seqlens=cu_seqlens)
    walk = None
    if on_nvidia_gpu(p.device):
        # Imported at the first call on an NVIDIA GPU, not with this module: Gluon and the kernel's
        # definitions are ~80 % of the op's import (benchmarks/plugin_load.py), and no other
        # platform can run them.
        from vllm_sinks.v1.attention.ops.gluon_full_attention import FullLaunch
        from vllm_sinks.v1.attention.ops.gluon_window_attention import WalkLaunch

        walk = WalkLaunch.plan(p, q, k, v, o, b_start_loc, b_seq_len, sinks) or \
            FullLaunch.plan(p, q, k, v, o, b_start_loc, b_seq_len, sinks)
    ours = Plan(walk, None, PortableLaunch.plan(p, q, k, v, o, b_start_loc, b_seq_len, sinks))
    upstream = _upstream_launch(p, args)
    if upstream is None:
        return ours
    theirs = Plan(None, upstream, ours.portable)
    if not measured_choice.may_measure(p.device):
        return dataclasses.replace(theirs, measured=False)  # upstream's own behaviour; not cached
    try:
        ours_wins, speedup = measured_choice.challenger_wins(
            lambda: theirs(q, k, v, o, b_start_loc, b_seq_len, sinks, max_input_len),
            lambda: ours(q, k, v, o, b_start_loc, b_seq_len, sinks, max_input_len))
    except Exception:  # noqa: BLE001 - ours failed (a ptxas crash: D 32 under 3.7.1's, session 14)
        # or upstream did (then its own call raises the same again): upstream's behaviour
        ours_wins, speedup = False, float("nan")
    return dataclasses.replace(ours if ours_wins else theirs, speedup=speedup)


# Plans by call signature: a ViT calls the op with the same shapes in every layer, and the checks
# and planning cost ~20 µs of Python, more than the kernel on small inputs.
_PLANS: dict = {}
_PLANS_MAX = 512
# The same plans by the arguments that are not tensors -> ((the C check of a validated signature's
# tensors, its plan), ...) (``signature_cache``): a seen signature costs ~1 µs of Python where its
# call key costs ~3 (the key is built on a miss only).
_SEEN: dict = {}
# Calls that go to upstream's op, by route key (``route_key``: the arguments that are not tensors)
# -> ((the C check of a validated signature's tensors, upstream's op), ...) (``signature_cache``): a
# call that passes a check was validated and planned before, and is handed to upstream with
# nothing of ours run again; any other goes through the checks and the plans.
_ROUTES: dict = {}


def route_key(max_input_len, is_causal, softmax_scale, sliding_window_q, sliding_window_k,
              sinks_bias_key0):
    """What of a routable call (no sinks, an int bound) its tensors' check does not hold: the
    arguments that are not tensors. ``context_attention_fwd`` builds the same tuple inline (a
    function call is a tenth of the budget of a routed call); the bound's value is in it because
    which op is faster depends on it."""
    return (max_input_len, is_causal, softmax_scale, sliding_window_q, sliding_window_k,
            sinks_bias_key0)


def remember(key, chosen: Plan) -> Plan:
    """Cache a plan under a call key (None: not cacheable) unless its choice was not measured."""
    if key is not None and chosen.measured:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        _PLANS[key] = chosen
    return chosen


def context_attention_fwd(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal=True,
                          softmax_scale=None, sliding_window_q=None, sliding_window_k=None,
                          sinks=None, sinks_bias_key0=False):
    """Attention over packed sequences with optional window and sinks; writes ``o`` in place.

    See the module docstring for the semantics. Raises ``ValueError`` on bad input.
    """
    if _ROUTES and sinks is None and type(max_input_len) is int:  # maybe a routed signature
        try:  # route_key, inline
            route = _ROUTES.get((max_input_len, is_causal, softmax_scale, sliding_window_q,
                                 sliding_window_k, sinks_bias_key0))
        except TypeError:  # unhashable arguments: validate says what is wrong
            route = None
        for check, upstream in route or ():
            if check(q, k, v, o, b_start_loc, b_seq_len):
                upstream(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal,
                         softmax_scale, sliding_window_q, sliding_window_k)
                return
    # A signature of ours seen before: the arguments that are not tensors (the bound's kind, not its
    # value, as in call_key), then one C check of the tensors' metadata (signature_cache).
    sink_tensor = signature_cache.NO_SINKS if sinks is None else sinks
    try:
        if isinstance(max_input_len, torch.Tensor):
            seen_key, bound_tensor = (is_causal, softmax_scale, sliding_window_q, sliding_window_k,
                                      sinks is None, sinks_bias_key0), max_input_len
        else:
            seen_key, bound_tensor = (is_causal, softmax_scale, sliding_window_q, sliding_window_k,
                                      sinks is None, sinks_bias_key0, type(max_input_len),
                                      max_input_len >= 0), signature_cache.INT_BOUND
        seen = _SEEN.get(seen_key)
    except TypeError:  # unhashable or incomparable arguments: validate says what is wrong
        seen_key = seen = None
    for check, chosen in seen or ():
        if check(q, k, v, o, b_start_loc, b_seq_len, sink_tensor, bound_tensor):
            if not chosen._ready or not chosen.launch_seen(
                    q, k, v, o, sinks, host_length_bound(max_input_len), b_start_loc.data_ptr(),
                    b_seq_len.data_ptr()):
                chosen(q, k, v, o, b_start_loc, b_seq_len, sinks, max_input_len)
            return
    key = call_key(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal, softmax_scale,
                   sliding_window_q, sliding_window_k, sinks, sinks_bias_key0)
    chosen = _PLANS.get(key) if key is not None else None
    if chosen is None:
        chosen = remember(key, plan(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal,
                                    softmax_scale, sliding_window_q, sliding_window_k, sinks,
                                    sinks_bias_key0))
    if chosen.measured:  # validated: the next call with this signature skips all of the above
        if chosen.upstream is not None and type(max_input_len) is int:  # straight to upstream
            signature_cache.remember(_ROUTES, route_key(max_input_len, is_causal, softmax_scale,
                                                        sliding_window_q, sliding_window_k,
                                                        sinks_bias_key0),
                                     (q, k, v, o, b_start_loc, b_seq_len),
                                     chosen.upstream.route(max_input_len).entry())
        elif seen_key is not None:
            signature_cache.remember(_SEEN, seen_key, (q, k, v, o, b_start_loc, b_seq_len,
                                                       sink_tensor, bound_tensor), chosen)
    chosen(q, k, v, o, b_start_loc, b_seq_len, sinks, max_input_len)
