"""The stream benchmark's whole loop on the CPU (``--cpu-smoke``: Triton's interpreter, tiny
shapes, one pass): a warm-up process and one process per path, both workloads, first sight and
seen again, and the report, so that it does not crash on its first run on the device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.kernels import benchmark_stream as stream
from benchmarks.kernels import peers

ROOT = Path(__file__).resolve().parents[2]


def test_the_stream_of_passes_is_new_shapes_and_seeded():
    cfg = stream.Config()
    passes = stream.stream_of_passes(cfg)
    assert passes == stream.stream_of_passes(cfg) and len(passes) == cfg.passes
    assert all(1 <= len(p) <= 3 and all(64 <= n <= 16384 for n in p) for p in passes)
    assert len({sum(p) for p in passes}) > 0.9 * cfg.passes  # token counts (call signatures) rarely repeat


def test_a_cpu_smoke_run_reports_every_path_and_workload(tmp_path):
    if peers.upstream_module() is None:
        import pytest

        pytest.skip("upstream op not fetched (benchmarks/kernels/fetch_peers.sh .gpu/peers)")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, str(ROOT / "benchmarks/kernels/benchmark_stream.py"), "--cpu-smoke",
                    "--passes", "1", "--out", str(tmp_path)], check=True, env=env, timeout=600,
                   capture_output=True)
    results = json.loads((tmp_path / "stream.json").read_text())["results"]
    assert [r["path"] for r in results] == list(stream.PATHS)
    for r in results:
        for w in ("full", "mimo"):
            assert len(r[w]["first"]) == len(r[w]["again"]) == 1 and r[w]["first"][0] > 0
            assert len(r[w]["round_cpus"]) == 1 and len(r[w]["round_cpus"][0]) == 2
        assert len(r["round_python_ns"]) == 1 and all(x > 0 for x in r["round_python_ns"][0])
        assert r["op_syncs"] == 0
    table = (tmp_path / "stream.md").read_text()
    assert table.count("| full |") == table.count("| mimo |") == len(stream.PATHS)


def test_rounds_merge_pass_by_pass_and_keep_each_process_total():
    def one(first, again, cpus=None):
        return dict(path="p", full=dict(first=first, again=again, cpus=cpus), op_syncs=0,
                    op_sync_ms=0.0, classes_ours=1, classes_upstream=0)

    merged = stream.merge_rounds([one([1.0, 9.0], [2.0], [3, 3]), one([3.0, 5.0], [2.0], [7, 9]),
                                  one([30.0, 4.0], [4.0])], ["full"])
    assert merged["full"]["first"] == [3.0, 5.0] and merged["full"]["again"] == [2.0]
    assert merged["full"]["round_totals"] == dict(first=[10.0, 8.0, 34.0], again=[2.0, 2.0, 4.0])
    assert merged["rounds"] == 3 and merged["op_syncs"] == 0
    table = stream.markdown([dict(merged, path="upstream")], "header", ["full"])
    assert "upstream 8–34, 2–4" in table
    assert "upstream 3/3, 7/9, ?" in table  # where each process ran


def test_pass_zero_is_reported_apart():
    """A process's first launches land in pass 0 on every path: the report gives its excess and the
    ratio without it."""
    def path(name, first, again):
        return dict(path=name, full=dict(first=first, again=again), op_syncs=0, op_sync_ms=0.0,
                    classes_ours=0, classes_upstream=0)

    results = [path("upstream", [500.0, 30.0, 30.0], [100.0, 30.0, 30.0]),
               path("ours", [420.0, 15.0, 15.0], [20.0, 15.0, 15.0])]
    table = stream.markdown(results, "header", ["full"])
    assert "upstream 400.0 ms, 1.00×; ours 400.0 ms, 2.00×" in table
    assert "| full | ours | 450.0 |" in table  # the totals keep pass 0
