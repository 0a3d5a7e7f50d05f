"""What ``vllm-sinks verify --model`` reads before it starts anything: the checkpoint, its config, the
prompts, and how much memory the reference needs. Pure Python plus ``safetensors`` headers (read as
JSON, no tensor is loaded), so every check here is unit-tested without vLLM or torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re
import struct
from typing import Iterable, Sequence


class ModelCheckError(Exception):
    """Bad input for ``verify --model``: the message says what is wrong and what to do."""


#: Built-in prompts: different lengths and kinds (prose, code, a list, a dialogue, one long text
#: that passes the 128-token sliding windows of GPT-OSS / Granite SWA / MiMo in real tokenizers).
DEFAULT_PROMPTS: tuple[str, ...] = (
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n    for _ in range(n):\n",
    "Shopping list: 3 eggs, 2 cups of flour, 1 litre of milk, 250 g of butter, a pinch of salt, and",
    "Q: Why does the sea look blue on a clear day?\nA:",
    ("Every morning the ferry crosses the bay to the island, where a small school and a lighthouse wait "
     "for the mail. The captain has made the trip for thirty years. In winter the crossing takes twice "
     "as long, because the wind from the north pushes the boat towards the rocks at the mouth of the "
     "harbour, and the captain has to steer a wide curve around the old wreck that nobody ever moved. "
     "The children on the island know the sound of the engine before they can see the boat: a low, "
     "uneven hum that grows louder as it rounds the point. They run down to the pier with their "
     "teachers, who wait for the newspapers, the letters from the mainland, and the crates of "
     "vegetables that the shop will sell by the afternoon. On the way back the ferry carries the "
     "island's own goods: baskets of fish packed in ice, wool from the sheep on the western hills, and "
     "sometimes a patient for the hospital in town, wrapped in blankets on a bench in the cabin. The "
     "lighthouse keeper writes a short report every evening: the weather, the ships that passed, the "
     "state of the lamp. In the spring the island holds a fair, and for one day the ferry runs every "
     "hour, full of visitors who want to see the cliffs, the birds, and the tower with its lamp. When "
     "the fair is over the island is quiet again, and the ferry goes back to its single crossing in "
     "the morning, as it has always done, and as the captain hopes it always will"),
)

_DTYPES = {"float32": "float32", "fp32": "float32", "float": "float32",
           "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16", "half": "float16"}
BYTES_PER_PARAM = {"float32": 4, "bfloat16": 2, "float16": 2}
#: Headroom over the fp32 weights for the reference: activations of a few hundred tokens, the
#: logits, allocator slack. The reference runs one prompt at a time, without a KV cache.
REFERENCE_OVERHEAD = 1.25
#: Of the memory that is free, leave this share to everything else on the machine.
USABLE_SHARE = 0.9


def canonical_dtype(dtype: str) -> str:
    key = str(dtype).removeprefix("torch.").lower()
    if key not in _DTYPES:
        raise ModelCheckError(f"dtype {dtype!r}: expected one of float32, bfloat16, float16 (or auto)")
    return _DTYPES[key]


# ---- the checkpoint -----------------------------------------------------------------------------

def _looks_like_hub_id(spec: str) -> bool:
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", spec) is not None and not spec.startswith(".")


def resolve_model(spec: str) -> pathlib.Path:
    """A local checkpoint directory, or the snapshot of a hub id already in the HF cache (no download)."""
    path = pathlib.Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelCheckError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
        return path.resolve()
    if path.exists():
        raise ModelCheckError(f"{spec} is a file: pass the checkpoint directory (the one with config.json)")
    if not _looks_like_hub_id(spec):
        raise ModelCheckError(f"{spec}: no such directory")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        raise ModelCheckError(f"{spec}: no such directory (and huggingface_hub is not installed)") from None
    try:
        snapshot = pathlib.Path(snapshot_download(spec, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        raise ModelCheckError(
            f"{spec}: neither a local directory nor a model in the local Hugging Face cache "
            f"({os.environ.get('HF_HUB_CACHE') or os.environ.get('HF_HOME') or '~/.cache/huggingface'}); "
            f"verify does not download: fetch it first (`hf download {spec}`)") from None
    if not (snapshot / "config.json").is_file():
        raise ModelCheckError(f"{spec}: the cached snapshot {snapshot} has no config.json")
    return snapshot


def read_config(model_dir: pathlib.Path) -> dict:
    try:
        return json.loads((model_dir / "config.json").read_text())
    except ValueError as e:
        raise ModelCheckError(f"{model_dir / 'config.json'} is not valid JSON: {e}") from None


def architecture(config: dict) -> str:
    archs = config.get("architectures") or []
    if not archs:
        raise ModelCheckError("config.json names no architecture (`architectures`): vLLM cannot pick a model class")
    return archs[0]


def config_dtype(config: dict) -> str:
    """The checkpoint's dtype from config.json (``dtype`` in transformers 5, ``torch_dtype`` before)."""
    value = config.get("dtype") or config.get("torch_dtype") or "float32"
    try:
        return canonical_dtype(value)
    except ModelCheckError:
        return "float32"


def needs_remote_code(config: dict, known_model_types: Iterable[str]) -> bool:
    """Does loading this checkpoint need its own code (``auto_map``, a ``model_type`` transformers lacks)?"""
    return bool(config.get("auto_map")) and config.get("model_type") not in set(known_model_types)


def max_positions(config: dict) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _safetensors_header(path: pathlib.Path) -> dict:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


def _first_number(name: str) -> int | None:
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    return None


def is_sink_name(name: str) -> bool:
    # Checkpoint names differ per family (``...self_attn.sinks``, DeepSeek's ``...attn.attn_sink``,
    # HY's ``...learnable_sink_param``): the last component mentions "sink".
    return "sink" in name.rsplit(".", 1)[-1].lower()


@dataclasses.dataclass
class Checkpoint:
    """What the safetensors headers say: parameter count and the layers that store a sink."""

    params: int
    sink_names: list[str]
    sink_layers: set[int] | None  # None: no safetensors to read (sinks unknown)

    @property
    def has_sinks(self) -> bool:
        return bool(self.sink_names)


def read_checkpoint(model_dir: pathlib.Path) -> Checkpoint:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return Checkpoint(params=_params_from_bin(model_dir), sink_names=[], sink_layers=None)
    params, names = 0, []
    for path in files:
        for name, meta in _safetensors_header(path).items():
            if name == "__metadata__":
                continue
            params += math.prod(meta.get("shape", []))
            if is_sink_name(name):
                names.append(name)
    layers = {n for n in map(_first_number, names) if n is not None}
    return Checkpoint(params=params, sink_names=sorted(names), sink_layers=layers)


def _params_from_bin(model_dir: pathlib.Path) -> int:
    # No safetensors: estimate from the file sizes (assume 2-byte weights, the common case).
    size = sum(p.stat().st_size for p in model_dir.glob("*.bin"))
    if size == 0:
        raise ModelCheckError(f"{model_dir}: no *.safetensors or *.bin weights")
    return size // 2


# ---- the reference's dtype ----------------------------------------------------------------------

def reference_dtype(params: int, model_dtype: str, available_bytes: int | None) -> tuple[str, str]:
    """HF eager runs in fp32 when its weights (plus activations) fit in what is free, else in the
    model's dtype. Returns (dtype, why) — the why is printed beside the table."""
    need = params * BYTES_PER_PARAM["float32"] * REFERENCE_OVERHEAD
    if model_dtype == "float32":
        return "float32", "the model's own dtype"
    if available_bytes is None:
        return model_dtype, "free memory unknown: the model's dtype"
    have = available_bytes * USABLE_SHARE
    if need <= have:
        return "float32", f"fits: ~{_size(need)} of {_size(available_bytes)} free"
    return model_dtype, (f"fp32 would need ~{_size(need)}, {_size(available_bytes)} free: "
                         f"the model's dtype (16-bit noise in every row)")


def _size(n: float) -> str:
    return f"{n / 2 ** 30:.1f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MiB"


def available_memory(device: str) -> int | None:
    """Free bytes where the reference runs: the GPU's free memory, or the host's MemAvailable."""
    if device != "cpu":
        try:
            import torch

            return int(torch.cuda.mem_get_info()[0]) if device == "cuda" else None
        except Exception:  # noqa: BLE001 - no CUDA runtime: say unknown
            return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


# ---- prompts ------------------------------------------------------------------------------------

def read_prompts(path: str | os.PathLike) -> list[str]:
    """One prompt per line; blank lines are skipped. ``\\n`` in a line stands for a newline."""
    path = pathlib.Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelCheckError(f"--prompts {path}: no such file") from None
    except UnicodeDecodeError as e:
        raise ModelCheckError(f"--prompts {path}: not UTF-8 text ({e})") from None
    prompts = [line.replace("\\n", "\n") for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ModelCheckError(f"--prompts {path}: no prompt in the file (one per line)")
    return prompts


def check_lengths(lengths: Sequence[int], continuation: int, max_model_len: int | None,
                  model_max: int | None, where: Sequence[str]) -> int:
    """The ``max_model_len`` to run with; a clear error if a prompt (plus its continuation) exceeds it.

    ``lengths``: tokens per prompt (bos included); ``where``: how to name each prompt in the error.
    Without ``max_model_len`` the runs get the smallest length that holds every prompt (a small KV
    cache), at least 128 and at most the model's own limit.
    """
    if continuation < 1:
        raise ModelCheckError(f"continuation length {continuation}: must be at least 1")
    for n, name in zip(lengths, where):
        if n < 2:
            raise ModelCheckError(f"{name} has {n} token(s): a prompt logprob needs at least 2")
    need = max(lengths) + continuation
    limit = max_model_len if max_model_len is not None else model_max
    if limit is not None:
        for n, name in zip(lengths, where):
            if n + continuation > limit:
                what = "--max-model-len" if max_model_len is not None else "the model's max_position_embeddings"
                raise ModelCheckError(
                    f"{name} has {n} tokens; with a continuation of {continuation} it needs {n + continuation} "
                    f"positions, over {what} ({limit}): shorten it or raise the limit")
    if max_model_len is not None:
        return max_model_len
    length = max(128, -(-need // 16) * 16)
    return min(length, model_max) if model_max is not None else length
