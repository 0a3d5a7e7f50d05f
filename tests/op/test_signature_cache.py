"""``signature_cache``: torch's C check of tensors' metadata, as the op's fast paths use it."""

from __future__ import annotations

import torch

from vllm_sinks.v1.attention.ops import signature_cache


def test_the_check_tells_dtype_shape_strides_and_device_apart():
    a, b = torch.zeros(4, 2, 8), torch.zeros(3, dtype=torch.int32)
    check = signature_cache.signature_check(a, b)
    assert check is not None and check(torch.ones(4, 2, 8), torch.ones(3, dtype=torch.int32))
    for other in (a.double(), a[:3], torch.zeros(4, 4, 8)[:, ::2], a.transpose(0, 1).contiguous()
                  .transpose(0, 1), a.to("meta")):
        assert not check(other, b)
    assert not check(a, 3)  # not a tensor


def test_one_tensor_twice_is_refused_and_a_torch_without_the_check_gives_none(monkeypatch):
    a = torch.zeros(2)
    assert signature_cache.signature_check(a, a) is None  # torch's check refuses aliases
    monkeypatch.setattr(signature_cache, "_GUARDS", [])
    monkeypatch.setattr(signature_cache, "_tensor_guards", lambda: None)
    assert signature_cache.signature_check(a) is None


def test_a_check_that_refuses_its_arguments_is_not_tried_again(monkeypatch):
    tries = []

    def refusing(*args, **kwargs):
        tries.append(args)
        raise TypeError("other arguments")

    monkeypatch.setattr(signature_cache, "_GUARDS", [refusing])
    assert signature_cache.signature_check(torch.zeros(2)) is None
    assert signature_cache.signature_check(torch.zeros(2)) is None
    assert len(tries) == 1


def test_remember_keeps_the_newest_few_signatures_per_key():
    cache: dict = {}
    tensors = [torch.zeros(n) for n in range(1, signature_cache.WAYS + 2)]
    for n, t in enumerate(tensors):
        signature_cache.remember(cache, "key", (t,), n)
    entries = cache["key"]
    assert [value for _, value in entries] == list(range(signature_cache.WAYS, 0, -1))
    assert not any(check(tensors[0]) for check, _ in entries)  # the oldest went
    assert entries[0][0](tensors[-1])
