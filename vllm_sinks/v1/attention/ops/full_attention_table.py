"""Which op runs a full-attention call that upstream's op may take: a shipped table of measurements.

Where the prefill-op patch registered upstream vLLM's op (``triton_prefill_attention.use_upstream_op``),
a call both ops can run (full attention, no sink, output in the input dtype) goes to ours only where
ours measured faster on calls of its *shape class*, on this GPU and Triton. Nothing is timed on the
request path: the measurements are data files shipped in the package (``tables/*.json``), written
by ``benchmarks/kernels/tune_full_attention.py`` on the GPU, one file per GPU and Triton release
(the scheme of vLLM's fused-MoE configs: tuned per device, looked up by bucketed shape).

A shape class is (head dim, dtype, causal, query heads per KV head, query-head bucket, length
bucket): ``heads_bucket(h)`` is the smallest ``b`` with ``h <= 2**b`` and ``length_bucket(n)`` the
same for the host bound on the longest sequence (``max_input_len``), at least ``MIN_LENGTH_BUCKET``
(every bound up to 64 is one bucket). A call whose bound is a device tensor has no host length:
upstream's op takes it (what vLLM without the plugin runs).

The table in force on a device (``find_table``): one the user tuned on this GPU (``vllm-sinks
tune``, in ``user_table_dir``), else one shipped for this GPU, else the architecture default: a
table of another GPU of the same compute capability under the same Triton release (an H100, H20,
H800 or GH200 reads the H200's sm_90 table). The front door looks each call class up once
(``route``: the tile and the verdicts of the class, per length bucket).

Lookup (``Table.decide``) of a class on that table:

1. measured: its verdict;
2. not measured, in a measured (head dim, dtype, causal) group: along each axis (length bucket,
   query-head bucket, queries per KV head) the nearest measured classes below and above that
   agree with it on the other two; an axis with both votes their verdict where they agree; an
   axis with only one below (the class is past the top of the grid: more heads, longer) votes
   ours where that one is ours by ``EDGE_RATIO``. The class takes a verdict only where at least
   one axis votes and no axis (or pair) disagrees;
3. a head dim the table did not measure: the verdicts of the nearest measured head dims of its
   dtype and causality on each side, where they agree;
4. anything else — another dtype, neighbours that disagree, no table for this architecture /
   Triton, a table that does not parse — is the fallback: upstream's op, which is never slower
   than vLLM without the plugin.

Each entry holds the measured ratio (upstream's time / ours, the worst of the class's variants; 0
where ours failed) and the verdict it implies: "ours" only where ours took at most ``MARGIN`` of upstream's time on
every variant, so the decision is data, not code (a verdict its ratio does not support is a
malformed table). Decisions are cached per class and device in a dict: a stream of new shapes costs
one dict lookup per new call signature, nothing on the device. A malformed table never fails a
user's call: it warns once and every class of that device falls back.

A table may also name, per (head dim, dtype, causal) group, the tile ours runs there (``tiles``,
``tile_of``): the tune script times candidate tiles on the group's long classes under the
table's Triton and keeps the fastest, so a choice that depends on the compiler (registers,
spills) is measured per release rather than fixed in code. The front door passes it to the
Hopper kernel's plan for every call of the group; a group without one runs the default tile.

The table read may be pointed elsewhere (``use_table_dir``: the tune's fresh table, the stream
benchmark's fallback run, tests); this module imports torch only.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import warnings
from pathlib import Path

import torch

FORMAT = "vllm-sinks full-attention table"
VERSION = 1
#: Ours must take at most this share of upstream's time on every variant of a class to run it: a
#: win smaller than what a few timed rounds resolve (a few % between runs on the H200) stays
#: upstream's, where a wrong choice would cost the caller.
MARGIN = 0.93
#: The smallest length bucket: every bound up to 2**6 = 64 tokens (the calls are host-bound there).
MIN_LENGTH_BUCKET = 6
#: Where the package's tables are (package data: pyproject.toml ships ``tables/*.json``).
SHIPPED_DIR = Path(__file__).resolve().with_name("tables")
#: A class past the top of the measured range on an axis (more heads, longer sequences, more queries
#: per KV head: more work per call) takes ours only where its neighbour below is ours by at least
#: this ratio: the margin of a measured class is what rounds of timing resolve; past it asks for more.
EDGE_RATIO = 1.25
VERDICTS = ("ours", "upstream")
DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


class TableError(ValueError):
    """A table file that does not hold what this module reads (says which file and what)."""


def length_bucket(max_len: int) -> int:
    """The smallest ``b >= MIN_LENGTH_BUCKET`` with ``max_len <= 2**b``."""
    return max(MIN_LENGTH_BUCKET, (max_len - 1).bit_length())


def heads_bucket(q_heads: int) -> int:
    """The smallest ``b`` with ``q_heads <= 2**b``."""
    return (q_heads - 1).bit_length()


def gpu_slug(name: str) -> str:
    """``torch.cuda.get_device_name`` as a file-name part: "NVIDIA H200" -> "nvidia-h200"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def triton_release(version: str) -> str:
    """Triton's ``major.minor`` ("3.8.0" -> "3.8"): patch releases share a table."""
    parts = version.split(".")
    if len(parts) < 2 or not parts[0].isdigit() or not parts[1].isdigit():
        raise TableError(f"Triton version {version!r} is not major.minor[.patch]")
    return f"{parts[0]}.{parts[1]}"


def table_name(gpu_name: str, capability: tuple[int, int], triton_version: str) -> str:
    """The file name of one GPU's table under one Triton release."""
    major, minor = capability
    return f"{gpu_slug(gpu_name)}_sm{major}{minor}_triton-{triton_release(triton_version)}.json"


@dataclasses.dataclass(frozen=True)
class ShapeClass:
    head_dim: int
    dtype: str  # a DTYPE_NAMES value
    causal: bool
    queries_per_kv: int
    heads_bucket: int
    length_bucket: int

    @property
    def group(self) -> tuple:
        return (self.head_dim, self.dtype, self.causal)

    @property
    def coordinates(self) -> tuple[int, int, int]:
        """Where the class sits in its group, in the order the lookup's axes are tried."""
        return (self.length_bucket, self.heads_bucket, self.queries_per_kv)


def shape_class(head_dim: int, dtype: torch.dtype, causal: bool, q_heads: int, kv_heads: int,
                max_len: int) -> ShapeClass:
    return ShapeClass(head_dim, DTYPE_NAMES.get(dtype, str(dtype)), bool(causal), q_heads // kv_heads,
                      heads_bucket(q_heads), length_bucket(max_len))


@dataclasses.dataclass(frozen=True)
class Table:
    """One GPU's measurements under one Triton release."""

    gpu: str
    capability: tuple[int, int]
    triton: str  # major.minor
    margin: float
    #: class -> (ours faster, ratio upstream / ours)
    entries: dict
    #: (head dim, dtype, causal) -> the tile ours ran there (``TILE_FIELDS``), where the tune
    #: script chose one by timing candidates; a group without one runs the kernel's default tile
    tiles: dict = dataclasses.field(default_factory=dict)

    def decide(self, c: ShapeClass) -> bool | None:
        """True: ours; False: upstream's op; None: the table cannot say (the caller falls back)."""
        hit = self.entries.get(c)
        if hit is not None:
            return hit[0]
        if not any(other.group == c.group for other in self.entries):
            return self._between_head_dims(c)
        votes = set()
        coords = c.coordinates
        for axis in range(len(coords)):
            below = above = None  # (distance, verdict, ratio) of the nearest measured class each side
            for other, (ours, ratio) in self.entries.items():
                oc = other.coordinates
                if other.group != c.group or any(oc[i] != coords[i] for i in range(3) if i != axis):
                    continue
                step = oc[axis] - coords[axis]
                if step > 0 and (above is None or step < above[0]):
                    above = (step, ours, ratio)
                elif step < 0 and (below is None or -step < below[0]):
                    below = (-step, ours, ratio)
            if below is not None and above is not None:
                votes.add(below[1] if below[1] == above[1] else None)
            elif below is not None:
                # past the top of the measured range on this axis (25 heads past 16, 32k tokens
                # past 16k: more work per call): only a clear win of ours next to it votes
                if below[1] and below[2] >= EDGE_RATIO:
                    votes.add(True)
        if len(votes) != 1 or None in votes:
            return None
        return votes.pop()

    def _between_head_dims(self, c: ShapeClass) -> bool | None:
        """A head dim the table did not measure (100 between 96 and 112): the verdict of the nearest
        measured head dims of its dtype and causality on each side, where both give the same one."""
        dims = sorted({o.head_dim for o in self.entries if (o.dtype, o.causal) == (c.dtype, c.causal)})
        below = [d for d in dims if d < c.head_dim]
        above = [d for d in dims if d > c.head_dim]
        if not below or not above:
            return None
        verdicts = {self.decide(dataclasses.replace(c, head_dim=d)) for d in (below[-1], above[0])}
        return verdicts.pop() if len(verdicts) == 1 else None


def _need(cond: bool, source: str, what: str) -> None:
    if not cond:
        raise TableError(f"{source}: {what}")


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _entry(e, source: str, where: str, margin: float) -> tuple[ShapeClass, tuple[bool, float]]:
    _need(isinstance(e, dict), source, f"{where} is not an object")
    for key in ("head_dim", "dtype", "causal", "queries_per_kv", "heads_bucket", "length_bucket",
                "verdict", "ratio"):
        _need(key in e, source, f"{where} has no {key!r}")
    _need(_int(e["head_dim"]) and 1 <= e["head_dim"] <= 256, source,
          f"{where}: head_dim must be an int in 1..256, got {e['head_dim']!r}")
    _need(e["dtype"] in DTYPE_NAMES.values(), source,
          f"{where}: dtype must be one of {sorted(DTYPE_NAMES.values())}, got {e['dtype']!r}")
    _need(isinstance(e["causal"], bool), source, f"{where}: causal must be true or false")
    for key, low in (("queries_per_kv", 1), ("heads_bucket", 0), ("length_bucket", MIN_LENGTH_BUCKET)):
        _need(_int(e[key]) and low <= e[key] <= 64, source,
              f"{where}: {key} must be an int in {low}..64, got {e[key]!r}")
    ratio = e["ratio"]
    # 0: ours failed on the class (a compile error), which is upstream's
    _need(isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and math.isfinite(ratio)
          and ratio >= 0, source, f"{where}: ratio must be a finite number >= 0, got {ratio!r}")
    _need(e["verdict"] in VERDICTS, source,
          f"{where}: verdict must be one of {VERDICTS}, got {e['verdict']!r}")
    ours = e["verdict"] == "ours"
    # The verdict is what the ratio implies (ours at most ``margin`` of upstream's time): an entry
    # whose verdict its measurement does not support is an edited or broken file.
    _need(ours == (ratio * margin >= 1.0), source,
          f"{where}: verdict {e['verdict']!r} does not follow from ratio {ratio} at margin {margin}")
    c = ShapeClass(e["head_dim"], e["dtype"], e["causal"], e["queries_per_kv"], e["heads_bucket"],
                   e["length_bucket"])
    return c, (ours, float(ratio))


#: A tile's fields as ``gluon_full_attention.TileConfig`` takes them, with what each may hold (the
#: kernel's ``FullLaunch.plan`` checks the combination).
TILE_FIELDS = {"block_m": (64, 128), "block_n": (32, 64, 128), "stages": (2, 3, 4, 5),
               "defer_pv": (False, True), "overlap": (False, True),
               "maxnreg": (None, *range(24, 257, 8)), "tma": (False, True)}
#: Fields a table written before them may leave out, with the value they then take.
TILE_DEFAULTS = {"tma": False}


def _tile(e, source: str, where: str) -> tuple[tuple, dict]:
    _need(isinstance(e, dict) and isinstance(e.get("tile"), dict), source,
          f"{where} is not an object with a 'tile' object")
    for key, check, what in (("head_dim", lambda x: _int(x) and 1 <= x <= 256, "an int in 1..256"),
                             ("dtype", lambda x: x in DTYPE_NAMES.values(), "a dtype name"),
                             ("causal", lambda x: isinstance(x, bool), "true or false")):
        _need(key in e and check(e[key]), source, f"{where}: {key} must be {what}, got {e.get(key)!r}")
    tile = dict(TILE_DEFAULTS, **e["tile"])
    _need(set(tile) == set(TILE_FIELDS), source,
          f"{where}: tile must have the fields {sorted(TILE_FIELDS)} ({sorted(TILE_DEFAULTS)} may "
          f"be left out), got {sorted(e['tile'])}")
    for key, allowed in TILE_FIELDS.items():
        value = tile[key]
        # 1 == True in Python: a bool is only a bool, an int only an int
        ok = any(value == a and type(value) is type(a) for a in allowed)
        _need(ok, source, f"{where}: tile {key} must be one of {allowed[:6]}…, got {value!r}"
              if len(allowed) > 6 else f"{where}: tile {key} must be one of {allowed}, got {value!r}")
    return (e["head_dim"], e["dtype"], e["causal"]), tile


def parse_table(data, source: str = "table") -> Table:
    """A table from its JSON document (``json.load``'s result); TableError says what is wrong."""
    _need(isinstance(data, dict), source, "not a JSON object")
    _need(data.get("format") == FORMAT, source, f"format must be {FORMAT!r}, got {data.get('format')!r}")
    _need(data.get("version") == VERSION, source,
          f"version must be {VERSION}, got {data.get('version')!r}")
    gpu, cap, release, margin = (data.get(k) for k in ("gpu", "capability", "triton", "margin"))
    _need(isinstance(gpu, str) and gpu, source, "gpu must be the device name (a string)")
    _need(isinstance(cap, list) and len(cap) == 2 and all(map(_int, cap)), source,
          f"capability must be [major, minor], got {cap!r}")
    _need(isinstance(release, str) and re.fullmatch(r"\d+\.\d+", release) is not None, source,
          f"triton must be major.minor, got {release!r}")
    _need(isinstance(margin, (int, float)) and not isinstance(margin, bool) and 0 < margin <= 1,
          source, f"margin must be in (0, 1], got {margin!r}")
    entries = data.get("entries")
    _need(isinstance(entries, list), source, "entries must be a list")
    table: dict = {}
    for i, e in enumerate(entries):
        c, value = _entry(e, source, f"entry {i}", float(margin))
        _need(c not in table, source, f"entry {i} repeats the class of an earlier entry: {c}")
        table[c] = value
    tiles_in = data.get("tiles", [])  # optional: a table without it runs the default tiles
    _need(isinstance(tiles_in, list), source, "tiles must be a list")
    tiles: dict = {}
    for i, e in enumerate(tiles_in):
        group, tile = _tile(e, source, f"tile {i}")
        _need(group not in tiles, source, f"tile {i} repeats the group of an earlier one: {group}")
        tiles[group] = tile
    return Table(gpu, (cap[0], cap[1]), release, float(margin), table, tiles)


def load_table(path: str | Path) -> Table:
    """Read and check one table file; TableError (with the path) when it does not parse."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
        raise TableError(f"{path}: {type(e).__name__}: {e}") from e
    return parse_table(data, str(path))


def table_document(gpu: str, capability: tuple[int, int], triton_version: str, entries: list[dict],
                   margin: float = MARGIN, tiles: list[dict] | None = None, **about) -> dict:
    """The JSON document of a table (what the tune script writes), checked by ``parse_table``.
    ``entries``: one dict per class (ShapeClass's fields, ``ratio``, anything informational such as
    ``variants``); each verdict is derived here from its ratio. ``tiles``: one dict per group
    whose tile was chosen by timing (head_dim, dtype, causal, ``tile``, anything informational such
    as the candidates' times). ``about``: provenance fields."""
    rows = [dict(e, verdict="ours" if e["ratio"] * margin >= 1.0 else "upstream") for e in entries]
    doc = dict(format=FORMAT, version=VERSION, gpu=gpu, capability=list(capability),
               triton=triton_release(triton_version), margin=margin, **about,
               **({"tiles": tiles} if tiles else {}), entries=rows)
    parse_table(doc, f"table for {gpu}")
    return doc


# ---- the process-wide lookup the front door makes -------------------------------------------------

#: Which table a device reads, in this order: one tuned on this GPU by ``vllm-sinks tune`` (the user's
#: cache), one shipped for this GPU, then the architecture default: a table of another GPU of the
#: same compute capability and Triton release (an H100, H20, H800 or GH200 takes the H200's sm_90
#: verdicts; sorted by name where several ship). None of them: upstream's op.
USER_TUNED, SHIPPED, ARCHITECTURE_DEFAULT, GIVEN = ("user-tuned", "shipped", "architecture default",
                                                    "given")


def user_table_dir() -> Path:
    """Where ``vllm-sinks tune`` writes and the op looks first: ``$XDG_CACHE_HOME/vllm-sinks/tables``
    (``~/.cache/vllm-sinks/tables`` where it is unset), as vLLM's tuned configs sit per user."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vllm-sinks" / "tables"


def _default_sources() -> list:
    return [(USER_TUNED, user_table_dir()), (SHIPPED, SHIPPED_DIR)]


_SOURCES: list = _default_sources()  # [(kind, directory)] searched in order (``use_table_dir``)
_TABLES: dict = {}  # (device type, index) -> InForce or None (no table, or one that did not parse)
_ROUTES: dict = {}  # (device, head dim, dtype, causal, q heads, kv heads) -> Route
_FORGET: list = []  # callables that drop verdicts kept elsewhere (the front door's plans)
_DEFAULT = object()


def use_table_dir(directory=_DEFAULT, kind: str = GIVEN) -> None:
    """Read tables from ``directory`` alone from now on, reported as ``kind`` (None: none at all,
    every class falls back to upstream's op; no argument: the user's cache, then the shipped ones);
    forgets the tables and routes read so far, here and in the front door."""
    if directory is _DEFAULT:
        _SOURCES[:] = _default_sources()
    else:
        _SOURCES[:] = [] if directory is None else [(kind, Path(directory))]
    _TABLES.clear()
    _ROUTES.clear()
    for forget in _FORGET:
        forget()


def device_identity(device: tuple[str, int | None]) -> tuple[str, tuple[int, int], str] | None:
    """(device name, compute capability, Triton version) a table is chosen by, for a (device type,
    index) pair; None off a CUDA device (no tables there)."""
    kind, index = device
    if kind != "cuda":
        return None
    import triton

    return (torch.cuda.get_device_name(index), tuple(torch.cuda.get_device_capability(index)),
            triton.__version__)


@dataclasses.dataclass(frozen=True)
class InForce:
    """The table a device reads, and why that one (``USER_TUNED``, ``SHIPPED``,
    ``ARCHITECTURE_DEFAULT`` or ``GIVEN``)."""

    kind: str
    path: Path
    table: Table

    def describe(self) -> str:
        where = f"{self.path}" if self.kind != ARCHITECTURE_DEFAULT else (
            f"{self.path.name}, measured on {self.table.gpu}")
        return f"{self.kind} table ({where})"


def _read(path: Path, name: str, cap: tuple, version: str, same_gpu: bool) -> Table | None:
    """The table at ``path`` where it holds this device's measurements; a file that does not parse
    or was measured elsewhere warns and reads as none."""
    try:
        table = load_table(path)
        _need(table.capability == tuple(cap) and table.triton == triton_release(version)
              and (not same_gpu or gpu_slug(table.gpu) == gpu_slug(name)), str(path),
              f"measured on {table.gpu} sm_{table.capability[0]}{table.capability[1]} "
              f"under Triton {table.triton}, not on this device")
        return table
    except TableError as e:
        warnings.warn(f"vllm-sinks: full-attention table ignored, upstream's op takes the calls "
                      f"it may take on this device: {e}", stacklevel=5)
        return None


def find_table(identity: tuple | None) -> InForce | None:
    """The table a device of this identity (``device_identity``) reads: its own, in the order of the
    sources, else the architecture default; None: upstream's op takes every call it may take."""
    if identity is None:
        return None
    name, cap, version = identity
    own = table_name(name, cap, version)
    for kind, directory in _SOURCES:
        path = directory / own
        if path.is_file():
            table = _read(path, name, cap, version, same_gpu=True)
            return None if table is None else InForce(kind, path, table)
    suffix = own[own.index("_sm"):]  # _sm90_triton-3.8.json: any GPU of this architecture
    for _, directory in _SOURCES:
        for path in sorted(directory.glob(f"*{suffix}")) if directory.is_dir() else ():
            table = _read(path, name, cap, version, same_gpu=False)
            if table is not None:
                return InForce(ARCHITECTURE_DEFAULT, path, table)
    return None


def _in_force(device: tuple) -> InForce | None:
    if device not in _TABLES:
        _TABLES[device] = None  # a failure below is not retried per call
        _TABLES[device] = find_table(device_identity(device))
    return _TABLES[device]


class Route:
    """What the device's table says of one call class but its length, looked up once per class:
    the tile ours runs there (None: the kernel's default), and per length bucket whether ours
    runs the call (``ours``) or upstream's op does."""

    __slots__ = ("fields", "table", "tile", "_ours")

    def __init__(self, fields: tuple, in_force: InForce | None):
        self.fields = fields  # ShapeClass's fields but the length bucket
        self.table = None if in_force is None else in_force.table
        self.tile = None if self.table is None else self.table.tiles.get(fields[:3])
        self._ours: dict = {}  # length bucket -> verdict

    def ours(self, max_len: int) -> bool:
        """Whether ours runs a call of this class with this host length bound."""
        bucket = length_bucket(max_len)
        verdict = self._ours.get(bucket)
        if verdict is None:
            verdict = self._ours[bucket] = bool(
                self.table is not None and self.table.decide(ShapeClass(*self.fields, bucket)))
        return verdict

    @property
    def decided(self) -> dict:
        """{length bucket: ours} of the calls routed so far (the stream benchmark counts them)."""
        return dict(self._ours)


def route(device: torch.device, head_dim: int, dtype: torch.dtype, causal: bool, q_heads: int,
          kv_heads: int) -> Route:
    """The one lookup of a call class (all of it but the length): its tile and its verdicts, from
    the table in force on its device (``find_table``), kept per class."""
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    key = ((device.type, index), head_dim, dtype, bool(causal), q_heads, kv_heads)
    found = _ROUTES.get(key)
    if found is None:
        fields = (head_dim, DTYPE_NAMES.get(dtype, str(dtype)), bool(causal), q_heads // kv_heads,
                  heads_bucket(q_heads))
        found = _ROUTES[key] = Route(fields, _in_force((device.type, index)))
    return found


def tables_in_force() -> list[str]:
    """One line per visible CUDA GPU: which table its full-attention calls read (``vllm-sinks
    report``): user-tuned, shipped, architecture default, or none (upstream's op)."""
    if not torch.cuda.is_available():
        return ["no CUDA GPU visible: no full-attention table in force (the choice is CUDA's only)"]
    try:
        import triton
    except ImportError as e:
        return [f"Triton does not import ({e}): no full-attention table in force"]
    lines = []
    for index in range(torch.cuda.device_count()):
        identity = device_identity(("cuda", index))
        name, (major, minor), version = identity
        found = find_table(identity)
        what = found.describe() if found is not None else (
            "none: upstream's op takes every full-attention call it may take "
            "(`vllm-sinks tune` writes a table for this GPU)")
        lines.append(f"GPU {index} {name} sm_{major}{minor}, Triton {version}: {what}")
    return lines
