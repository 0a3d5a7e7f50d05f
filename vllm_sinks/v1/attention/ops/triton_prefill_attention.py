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
2. ``gluon_full_attention.FullLaunch`` — no window, on an NVIDIA Hopper GPU (Gluon);
3. ``prefill_attention_portable.PortableLaunch`` — the portable Triton kernel: every call (and
   the fallback of a Hopper variant that fails to compile).

A call's class (device, head dim, dtype, causality, heads: ``full_attention_table.route``) is
looked up once in the table in force on its device (one tuned there by ``vllm-sinks tune``, one
shipped for that GPU, else the architecture default: another sm_90 GPU's under the same Triton);
that one ``Route`` gives the tile the Hopper kernel runs and, per length bucket, whether ours or
upstream's op runs the call. Where the prefill-op patch registered upstream vLLM's own op
(``use_upstream_op``), a call it may take (``upstream_may_take``: full attention, no sink, output
in the input dtype) goes to it unless the route says ours is faster there; a call with a
device-tensor bound, or of a class no table can decide, goes to upstream's op (never slower than
vLLM without the plugin). Such a call runs upstream's function as it is. Nothing is timed or
synchronised on the request path.

A call signature (shapes, strides, dtypes, devices, arguments: ``call_key``, a flat tuple, ~3 µs) is
validated and planned once; later calls with it take the plan from a dict, and ours go straight to
the C launch its kernel took before with the same length bound (``Plan.launch_seen``). Once a
class and length bucket went to upstream's op, its later calls (new token counts too) go straight
there after ~10 attribute reads (``upstream_key``), not validated again by us: what varies per call
(token counts, offsets) upstream's op checks as it does without the plugin.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Callable

from vllm_sinks.v1.attention.ops import full_attention_table, kernel_launcher
from vllm_sinks.v1.attention.ops.prefill_attention_portable import PortableLaunch
from vllm_sinks.v1.attention.ops.prefill_attention_problem import (
    Problem,
    call_key,
    host_length_bound,
    on_nvidia_gpu,
    validate,
)

if TYPE_CHECKING:
    from vllm_sinks.v1.attention.ops.gluon_full_attention import FullLaunch
    from vllm_sinks.v1.attention.ops.gluon_window_attention import WalkLaunch

# ---- upstream's op, where the table says it is the faster one --------------------------------------

_UPSTREAM: list = []  # [upstream's context_attention_fwd], set by the prefill-op patch


def use_upstream_op(fn: Callable | None) -> None:
    """Let calls that upstream's op can take (``upstream_may_take``) go to ``fn`` (upstream vLLM's
    ``context_attention_fwd``, which the prefill-op patch replaces) unless the table says ours is
    faster on their class (``full_attention_table``); None: never."""
    _UPSTREAM[:] = [fn] if fn is not None else []
    forget_plans()


def upstream_may_take(p: Problem) -> bool:
    """Calls upstream's op runs with our semantics on every supported release: plain attention (no
    window, no sink), output in the input dtype. (In fp32 upstream's dots run in TF32, ours in IEEE
    fp32: where upstream takes a call, it gets exactly what vLLM without the plugin gives.)"""
    return p.full_attention and p.dtype == p.out_dtype and not p.empty and not p.cu_seqlens


# ---- the op ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Plan:
    """The launches that take one call signature, first choice first (a Hopper launch keeps the
    portable one as its fallback, for a variant that fails to compile), and upstream's op where it
    may take the call (``route``: the table's word on the call's class, for its length)."""

    walk: WalkLaunch | None
    full: FullLaunch | None
    portable: PortableLaunch
    upstream: Callable | None = None
    route: full_attention_table.Route | None = None
    #: length bound -> the direct C launch of the kernel that ran this signature with it
    #: (``DirectLauncher.ready``), for ``launch_seen``; filled by the calls that launch
    _ready: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def kernel(self) -> str:
        """Which of our kernels this call signature runs (for the benchmarks' tables)."""
        return (self.walk or self.full or self.portable).name

    def upstream_takes(self, max_input_len) -> bool:
        """Whether this call goes to upstream's op: it may take it, and the table does not say ours
        is faster on its class and length bucket (a device-tensor bound has no host length: upstream)."""
        if self.upstream is None:
            return False
        hint = host_length_bound(max_input_len)
        return hint is None or not self.route.ours(hint)

    def __call__(self, q, k, v, o, b_start_loc, b_seq_len, sinks, max_input_len):
        """Launch ours (upstream's op is the caller's to call: ``upstream_takes``)."""
        hint = host_length_bound(max_input_len)
        launch = self.walk or self.full
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


_REFUSED_TILES: set = set()  # tiles of a table the kernel's plan refused (warned once each)


def _full_launch(full_launch, p: Problem, q, k, v, o, b_start_loc, b_seq_len, sinks, tile):
    """The Hopper full-attention launch of a call (``FullLaunch.plan``), with the tile the
    device's table chose for its group (``Route.tile``) where it chose one. A tile the plan
    refuses is the table's fault, not the caller's: warned once, default tile."""
    if tile is not None:
        from vllm_sinks.v1.attention.ops.gluon_full_attention import TileConfig

        key = tuple(sorted(tile.items()))
        if key not in _REFUSED_TILES:
            try:
                return full_launch.plan(p, q, k, v, o, b_start_loc, b_seq_len, sinks,
                                        tile=TileConfig(**tile))
            except ValueError as e:
                _REFUSED_TILES.add(key)
                warnings.warn(f"vllm-sinks: the full-attention table's tile {tile} is refused "
                              f"({e}); the default tile runs", stacklevel=4)
    return full_launch.plan(p, q, k, v, o, b_start_loc, b_seq_len, sinks)


def plan(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal=True, softmax_scale=None,
         sliding_window_q=None, sliding_window_k=None, sinks=None, sinks_bias_key0=False,
         cu_seqlens: bool = False) -> Plan:
    """Validate a call (``context_attention_fwd``'s arguments) and choose its kernels; nothing runs.
    ``cu_seqlens`` (the MiMo wrapper's calls only): b_start_loc and b_seq_len are one tensor of
    cumulative offsets [num_seqs + 1], which the kernels read as is (``Problem.cu_seqlens``); the
    launches then take it in both places."""
    p = validate(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal, softmax_scale,
                 sliding_window_q, sliding_window_k, sinks, sinks_bias_key0, cu_seqlens=cu_seqlens)
    upstream = _UPSTREAM[0] if _UPSTREAM and upstream_may_take(p) else None
    nvidia = on_nvidia_gpu(p.device)
    # the one table lookup of the call's class: its tile (ours) and its verdict (ours or upstream's)
    route = full_attention_table.route(p.device, p.head_dim, p.dtype, p.is_causal, p.q_heads,
                                       p.kv_heads) if nvidia or upstream is not None else None
    walk = full = None
    if nvidia:
        # Imported at the first call on an NVIDIA GPU, not with this module: Gluon and the kernels'
        # definitions are ~80 % of the op's import (benchmarks/plugin_load.py), and no other
        # platform can run them.
        from vllm_sinks.v1.attention.ops.gluon_full_attention import FullLaunch
        from vllm_sinks.v1.attention.ops.gluon_window_attention import WalkLaunch

        walk = WalkLaunch.plan(p, q, k, v, o, b_start_loc, b_seq_len, sinks)
        if walk is None:
            full = _full_launch(FullLaunch, p, q, k, v, o, b_start_loc, b_seq_len, sinks, route.tile)
    portable = PortableLaunch.plan(p, q, k, v, o, b_start_loc, b_seq_len, sinks)
    return Plan(walk, full, portable, upstream, route if upstream is not None else None)


# Plans by call signature: a ViT calls the op with the same shapes in every layer, and the checks
# and planning cost ~20 µs of Python, more than the kernel on small inputs; the key ~3.
_PLANS: dict = {}
_PLANS_MAX = 512
#: Calls upstream's op takes, by what of a call decides that (``upstream_key``) -> True: a call of a
#: class and length bucket seen going there goes straight on, not validated again by us
#: (upstream's op checks it as vLLM without the plugin does), so the fallback costs ~1 µs.
_TO_UPSTREAM: dict = {}


def forget_plans() -> None:
    _PLANS.clear()
    _TO_UPSTREAM.clear()


full_attention_table._FORGET.append(forget_plans)  # plans keep their table's routes


def remember(key, chosen: Plan) -> Plan:
    """Cache a plan under a call key (None: not cacheable)."""
    if key is not None:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        _PLANS[key] = chosen
    return chosen


def upstream_key(q, k, v, o, max_input_len: int, is_causal, softmax_scale, sliding_window_q,
                 sliding_window_k):
    """What decides whether upstream's op takes a call with no sink and a positive int bound: the
    class (heads, head dim, dtypes, device, causality, windows), the scale (a bad one is never
    keyed: ours says what is wrong) and the bound's power of two, not the token count (a server's
    every pass has new ones). ~10 attribute reads."""
    shape = q.shape
    return (shape[1], shape[2], k.shape[1], q.dtype, k.dtype, v.dtype, o.dtype, q.get_device(),
            is_causal, softmax_scale, sliding_window_q, sliding_window_k,
            (max_input_len - 1).bit_length())


def context_attention_fwd(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal=True,
                          softmax_scale=None, sliding_window_q=None, sliding_window_k=None,
                          sinks=None, sinks_bias_key0=False):
    """Attention over packed sequences with optional window and sinks; writes ``o`` in place.

    See the module docstring for the semantics. Raises ``ValueError`` on bad input.
    """
    if _TO_UPSTREAM and sinks is None and type(max_input_len) is int and max_input_len > 0:
        try:  # ``upstream_key``, inlined: a Python call is ~0.2 µs of the ~1 µs this path costs
            shape = q.shape
            to_upstream = (shape[1], shape[2], k.shape[1], q.dtype, k.dtype, v.dtype, o.dtype,
                           q.get_device(), is_causal, softmax_scale, sliding_window_q,
                           sliding_window_k, (max_input_len - 1).bit_length()) in _TO_UPSTREAM
        except Exception:  # noqa: BLE001 - not tensors, unhashable: the checks below say what
            to_upstream = False
        if to_upstream:
            _UPSTREAM[0](q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal,
                         softmax_scale, sliding_window_q, sliding_window_k)
            return
    key = call_key(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal, softmax_scale,
                   sliding_window_q, sliding_window_k, sinks, sinks_bias_key0)
    chosen = _PLANS.get(key) if key is not None else None
    if chosen is None:
        chosen = remember(key, plan(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal,
                                    softmax_scale, sliding_window_q, sliding_window_k, sinks,
                                    sinks_bias_key0))
    if chosen.upstream is not None and chosen.upstream_takes(max_input_len):
        if type(max_input_len) is int and max_input_len > 0:  # this class and bucket: straight on
            if len(_TO_UPSTREAM) >= _PLANS_MAX:
                _TO_UPSTREAM.clear()
            _TO_UPSTREAM[upstream_key(q, k, v, o, max_input_len, is_causal, softmax_scale,
                                      sliding_window_q, sliding_window_k)] = True
        # upstream's own function, as vLLM without the plugin calls it (no sink: none passed, which
        # also suits releases whose op has no sink arguments)
        chosen.upstream(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal, softmax_scale,
                        sliding_window_q, sliding_window_k)
        return
    if chosen._ready and chosen.launch_seen(q, k, v, o, sinks, host_length_bound(max_input_len),
                                            b_start_loc.data_ptr(), b_seq_len.data_ptr()):
        return
    chosen(q, k, v, o, b_start_loc, b_seq_len, sinks, max_input_len)
