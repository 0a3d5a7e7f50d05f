"""Same-run benchmark peers, loaded from the files ``fetch_peers.sh`` puts in DIR (default ``.gpu/peers``).

Nothing here holds vLLM code: the peers are vLLM's own files, fetched from the vllm 0.34.0 wheel at run
time into a git-ignored folder, and loaded without vLLM installed (the GPU machine has none).

- :func:`upstream_op` — vLLM's ``context_attention_fwd`` (``vllm/v1/attention/ops/
  triton_prefill_attention.py``), the op our plugin replaces. Same signature as ours. The file imports
  ``vllm.platforms.current_platform``, ``vllm.triton_utils.{tl, triton}``,
  ``vllm.utils.math_utils.RCP_LN2`` and (from 0.34) ``vllm.utils.mem_utils.get_max_shared_memory_bytes``: those come from a minimal shim that sits in ``sys.modules`` under
  the ``vllm.*`` names only while the file executes (any real ``vllm`` modules are put back after);
  the module itself is registered under a private name. ``math_utils`` is vLLM's own file (stdlib
  only) when it was fetched. Works on a GPU and in Triton's interpreter (``TRITON_INTERPRET=1``, set
  before the first call of :func:`upstream_op`: Triton reads it when the kernel is decorated).
- :func:`fa3_varlen` — vLLM's FlashAttention-3 build (``flash_attn_varlen_func(..., fa_version=3)``),
  unpacked from ``fa3/_vllm_fa3_C.abi3.so.xz`` (``fetch_peers.sh`` writes it) into a temporary
  package. Hopper only; on the CPU it returns None.

Each returns None, after printing why, when the files are missing or cannot be loaded here.

    from benchmarks.kernels.peers import upstream_op, fa3_varlen
    up = upstream_op(".gpu/peers")      # up(q, k, v, o, b_start_loc, b_seq_len, max_input_len, ...)
    fa3 = fa3_varlen(".gpu/peers")      # fa3(q, k, v, o, cu_seqlens, max_seqlen, causal, ...)
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import shutil
import sys
import tempfile
import threading
import types
from pathlib import Path

import torch

DEFAULT_DIR = Path(__file__).resolve().parents[2] / ".gpu" / "peers"
UPSTREAM_FILE = Path("upstream") / "triton_prefill_attention.py"
UPSTREAM_MATH_UTILS = Path("upstream") / "math_utils.py"
FA3_SO_XZ = Path("fa3") / "_vllm_fa3_C.abi3.so.xz"
FA3_INTERFACE = Path("fa3") / "flash_attn_interface.py"

_UPSTREAM_MODULE = "_vllm_sinks_peer_upstream_prefill"
_MATH_UTILS_MODULE = "_vllm_sinks_peer_upstream_math_utils"
_FA3_PACKAGE = "_vllm_sinks_peer_fa3"
_SHIM_PREFIX = "_vllm_sinks_peer_shim."
_LOCK = threading.Lock()


def _dir(dir) -> Path:
    return DEFAULT_DIR if dir is None else Path(dir)


def _why_not(peer: str, reason: str) -> None:
    print(f"[peers] {peer}: not available: {reason}", flush=True)


def peer_release(dir=None) -> str:
    """Which vLLM's files the peers are ("vLLM 0.34.0"), read from ``SOURCE``; "unknown" without it.
    The tables and the stream rows name it: upstream's op changes between releases (0.34's tile
    shrinks to fit shared memory)."""
    source = _dir(dir) / "SOURCE"
    first = source.read_text().split() if source.is_file() else []
    if len(first) >= 2 and first[0] == "wheel" and first[1].startswith("vllm-"):
        return f"vLLM {first[1].split('-')[1]}"
    return "unknown"


# ---- vLLM's prefill op -------------------------------------------------------------------------------

class _ShimPlatform:
    """The three ``current_platform`` methods the upstream op calls (a CUDA or CPU machine; not ROCm)."""

    def is_rocm(self) -> bool:
        return False  # a True here would make the op import vllm.platforms.rocm, which is not shimmed

    def is_cuda(self) -> bool:
        return torch.cuda.is_available() and torch.version.hip is None

    def is_xpu(self) -> bool:
        return False

    def is_cuda_alike(self) -> bool:
        return torch.cuda.is_available()

    def has_device_capability(self, capability, device_id: int = 0) -> bool:
        if not torch.cuda.is_available():
            return False
        major, minor = torch.cuda.get_device_capability(device_id)
        want = capability[0] * 10 + capability[1] if isinstance(capability, tuple) else int(capability)
        return major * 10 + minor >= want


def _max_shared_memory_bytes(gpu: int = 0) -> int:
    """The opt-in shared memory a block may take on ``gpu`` (what vLLM's ``mem_utils`` asks CUDA)."""
    return int(torch.cuda.get_device_properties(gpu).shared_memory_per_block_optin)


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(_SHIM_PREFIX + name)
    m.__dict__.update(attrs)
    return m


def _exec_file(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # private name; Triton and inspect find the kernel's source through it
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return mod


def _shim_modules(d: Path) -> dict[str, types.ModuleType]:
    import triton
    import triton.language as tl

    math_file = d / UPSTREAM_MATH_UTILS
    if math_file.is_file():
        math_utils = sys.modules.get(_MATH_UTILS_MODULE) or _exec_file(math_file, _MATH_UTILS_MODULE)
    else:  # fetched by an older fetch_peers.sh: 1/ln 2 (vLLM's constant is this to ~1e-8)
        math_utils = _module("vllm.utils.math_utils", RCP_LN2=1.0 / math.log(2.0))
    vllm = _module("vllm")
    vllm.__path__ = []  # a package, so ``import vllm.x`` looks for submodules (in sys.modules only)
    platforms = _module("vllm.platforms", current_platform=_ShimPlatform())
    triton_utils = _module("vllm.triton_utils", triton=triton, tl=tl)
    mem_utils = _module("vllm.utils.mem_utils", get_max_shared_memory_bytes=_max_shared_memory_bytes)
    utils = _module("vllm.utils", math_utils=math_utils, mem_utils=mem_utils)
    utils.__path__ = []
    vllm.platforms, vllm.triton_utils, vllm.utils = platforms, triton_utils, utils
    return {"vllm": vllm, "vllm.platforms": platforms, "vllm.triton_utils": triton_utils,
            "vllm.utils": utils, "vllm.utils.math_utils": math_utils,
            "vllm.utils.mem_utils": mem_utils}


@functools.lru_cache(maxsize=None)
def _load_upstream(path: str) -> types.ModuleType:
    """Execute the upstream op file with the shim in place; put back whatever ``vllm.*`` was there."""
    p = Path(path)
    with _LOCK:
        shims = _shim_modules(p.parent.parent)
        saved = {name: sys.modules[name] for name in shims if name in sys.modules}
        sys.modules.update(shims)
        try:
            return _exec_file(p, _UPSTREAM_MODULE)
        finally:
            for name in shims:
                if name in saved:
                    sys.modules[name] = saved[name]
                else:
                    sys.modules.pop(name, None)


def upstream_module(dir=None) -> types.ModuleType | None:
    """The upstream op's module (its ``_fwd_kernel``, ``get_block_size``, ...), or None (printed why)."""
    path = _dir(dir) / UPSTREAM_FILE
    if not path.is_file():
        _why_not("upstream op", f"{path} is missing (run benchmarks/kernels/fetch_peers.sh "
                 f"{_dir(dir)} and carry that folder)")
        return None
    try:
        return _load_upstream(str(path.resolve()))
    except Exception as e:  # noqa: BLE001 - e.g. a newer upstream file importing what the shim lacks
        _why_not("upstream op", f"{path} does not load with the shim: {type(e).__name__}: {e}")
        return None


def upstream_op(dir=None):
    """vLLM's ``context_attention_fwd(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal=True,
    softmax_scale=None, sliding_window_q=None, sliding_window_k=None, sinks=None, sinks_bias_key0=False)``.

    Upstream sizes its grid with ``triton.cdiv(max_input_len, BLOCK)``: it needs a Python int. A tensor
    is turned into one here with ``int()`` (a device→host sync for a device tensor, as vLLM's ViT
    wrapper does with ``.item()``); pass an int to time the op alone. The raw function is ``.raw``,
    its module ``.module``. None (printed why) when the file is missing or does not load.
    """
    mod = upstream_module(dir)
    if mod is None:
        return None
    fwd = mod.context_attention_fwd

    @functools.wraps(fwd)
    def op(q, k, v, o, b_start_loc, b_seq_len, max_input_len, *args, **kwargs):
        if isinstance(max_input_len, torch.Tensor):
            max_input_len = int(max_input_len)
        return fwd(q, k, v, o, b_start_loc, b_seq_len, max_input_len, *args, **kwargs)

    op.raw = fwd
    op.module = mod
    return op


# ---- vLLM's FlashAttention-3 -------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _load_fa3_interface(d: str) -> types.ModuleType:
    """Unpack the .so into a temporary private package, import its interface, delete the copy.

    The interface imports ``from . import _vllm_fa3_C`` (registers ``torch.ops._vllm_fa3_C``) and
    records an ImportError in ``FA3_UNAVAILABLE_REASON`` instead of raising; FA2 and FA4 are absent
    (their failed imports are expected). The unpacked library stays mapped after its file is removed.
    """
    import lzma

    root = Path(d)
    tmp = Path(tempfile.mkdtemp(prefix="vllm_sinks_fa3_"))
    try:
        pkg = tmp / _FA3_PACKAGE
        pkg.mkdir()
        with lzma.open(root / FA3_SO_XZ) as src, open(pkg / "_vllm_fa3_C.abi3.so", "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 24)
        shutil.copy(root / FA3_INTERFACE, pkg / "flash_attn_interface.py")
        (pkg / "__init__.py").touch()
        with _LOCK:
            spec = importlib.util.spec_from_file_location(
                _FA3_PACKAGE, pkg / "__init__.py", submodule_search_locations=[str(pkg)])
            package = importlib.util.module_from_spec(spec)
            sys.modules[_FA3_PACKAGE] = package
            spec.loader.exec_module(package)
            return importlib.import_module(f"{_FA3_PACKAGE}.flash_attn_interface")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fa_window(w) -> int:
    """Our window convention (None, 0 or -1: unbounded) to flash-attn's (-1: unbounded, 0: none)."""
    if isinstance(w, torch.Tensor):
        w = int(w)
    return -1 if w is None or w <= 0 else int(w)


def cu_seqlens_from(b_start_loc: torch.Tensor, b_seq_len: torch.Tensor) -> torch.Tensor:
    """int32 [B + 1] cumulative lengths for sequences packed back to back (FA's layout); host sync."""
    lens = b_seq_len.to(torch.int32)
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=lens.device)
    cu[1:] = torch.cumsum(lens, 0)
    if not torch.equal(cu[:-1], b_start_loc.to(cu.device, torch.int32)):
        raise ValueError("sequences are not packed back to back from row 0: no cu_seqlens for them")
    return cu


def fa3_varlen(dir=None, *, need_cuda: bool = True):
    """vLLM's FA3 as ``fa3(q, k, v, o, cu_seqlens, max_seqlen, causal=False, window_left=None,
    window_right=None, sinks=None, softmax_scale=None) -> o`` (writes ``o`` in place), or None.

    - q [tokens, Hq, D], k/v [tokens, Hkv, D], fp16/bf16; ``cu_seqlens`` int32 [B + 1] on the GPU
      (:func:`cu_seqlens_from` builds it from ``b_start_loc``/``b_seq_len``); ``max_seqlen`` an int.
    - windows in our op's convention: key j is visible to query i when ``i - j <= window_left`` and
      ``j - i <= window_right``; None, 0 or -1 leave that side unbounded (passed to FA3 as -1).
    - ``sinks`` [Hq]: null-logit sinks (FA3's ``s_aux``; it has no key-0 mode). The library accepts
      only bf16 there ("We only support bf16 dtype for S aux."), Hq <= 64, Hopper: other dtypes are
      converted on each call (pass bf16 sinks to time FA3 alone).
    """
    d = _dir(dir)
    missing = [str(d / f) for f in (FA3_SO_XZ, FA3_INTERFACE) if not (d / f).is_file()]
    if missing:
        _why_not("FA3", f"{', '.join(missing)} missing (run benchmarks/kernels/fetch_peers.sh {d})")
        return None
    if need_cuda and not torch.cuda.is_available():
        _why_not("FA3", "needs a CUDA GPU (Hopper)")
        return None
    try:
        iface = _load_fa3_interface(str(d.resolve()))
    except Exception as e:  # noqa: BLE001
        _why_not("FA3", f"the interface does not import: {type(e).__name__}: {e}")
        return None
    if not getattr(iface, "FA3_AVAILABLE", False):
        _why_not("FA3", f"the library does not load here: {getattr(iface, 'FA3_UNAVAILABLE_REASON', '?')}")
        return None
    varlen = iface.flash_attn_varlen_func

    def fa3(q, k, v, o, cu_seqlens, max_seqlen, causal=False, window_left=None, window_right=None,
            sinks=None, softmax_scale=None):
        if isinstance(max_seqlen, torch.Tensor):
            max_seqlen = int(max_seqlen)
        s_aux = None if sinks is None else sinks.to(torch.bfloat16).contiguous()
        varlen(q, k, v, max_seqlen, cu_seqlens, max_seqlen, cu_seqlens, softmax_scale=softmax_scale,
               causal=causal, window_size=[_fa_window(window_left), _fa_window(window_right)], out=o,
               fa_version=3, s_aux=s_aux)
        return o

    fa3.interface = iface
    return fa3


if __name__ == "__main__":  # python benchmarks/kernels/peers.py [DIR]: what loads here
    where = sys.argv[1] if len(sys.argv) > 1 else None
    print("upstream op:", "loaded" if upstream_op(where) is not None else "no")
    print("FA3:", "loaded" if fa3_varlen(where) is not None else "no",
          f"(TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')})")
