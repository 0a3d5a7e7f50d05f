"""transformers-sinks and transformers-kv-heads wrap the same `Base` method and each rebinds upstream's
module-level `Attention` for the call: they compose in either order (the registry fixes one, see
`Patch.after`), each layer getting its sink and its own KV heads, and upstream's name is restored."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("torch")
pytest.importorskip("vllm")

from tests.vllm.test_transformers_sinks import FakeAttention, FakeBackend  # noqa: E402
from vllm_sinks.model_executor.models.transformers import base as ours  # noqa: E402
from vllm_sinks.patches import PATCHES  # noqa: E402

SINKS, KV = "transformers-sinks", "transformers-kv-heads"
WRAPPERS = {SINKS: ours.create_attention_instances, KV: ours.kv_create_attention_instances}


def test_the_registry_stacks_kv_heads_around_sinks():
    names = [p.name for p in PATCHES]
    assert names.index(SINKS) < names.index(KV) and SINKS in PATCHES[names.index(KV)].after


@pytest.mark.parametrize("outer, inner", [(KV, SINKS), (SINKS, KV)], ids=["registry order", "reversed"])
def test_the_base_patches_compose_in_either_order(outer, inner, monkeypatch):
    import vllm.model_executor.models.transformers.base as upstream_base

    monkeypatch.setattr(upstream_base, "Attention", FakeAttention)
    built = []

    def upstream(self):  # upstream's method: builds each layer through the module's name
        cls = vars(upstream_base)["Attention"]
        built.append(cls)
        return {i: cls(prefix=f"{i}.attn", num_heads=8, num_kv_heads=8) for i in range(len(self.model.layers))}

    # Stack them as install.install would: the outer one's original is the inner one.
    monkeypatch.setattr(WRAPPERS[inner], "__vllm_sinks_original__", upstream, raising=False)
    monkeypatch.setattr(WRAPPERS[outer], "__vllm_sinks_original__", WRAPPERS[inner], raising=False)
    backend = FakeBackend()
    ours.discover_sinks(backend.model)
    geometry = {0: ours.KvGeometry("layers.0", 2, 4, 4), 1: ours.KvGeometry("layers.1", 4, 4, 4)}
    monkeypatch.setitem(ours._KV, backend, geometry)

    instances = WRAPPERS[outer](backend)

    assert instances[0].sinks is backend.model.layers[0].holder.head_logit and instances[0].has_sink
    assert instances[1].sinks is None
    assert [instances[i].kwargs["num_kv_heads"] for i in (0, 1)] == [2, 4]
    assert built[0] is not FakeAttention  # upstream saw the stand-ins, nested
    assert upstream_base.Attention is FakeAttention  # and its name is restored after the call
