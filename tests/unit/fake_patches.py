"""Hook modules for registry tests: each behaves like one kind of real patch."""

from vllm_sinks.patches.registry import Drift, NotApplicable, Probe

CALLS: list[str] = []


class Target:
    """Stands in for an upstream module whose function a patch replaces."""

    @staticmethod
    def fn():
        return "upstream"


def _ours():
    return "ours"


def probe_applies(info):
    return Probe(True, "upstream lacks the feature")


def probe_stands_down(info):
    return Probe(False, "upstream has the feature (vLLM ≥0.30)")


def probe_drift(info):
    raise Drift("Target.fn() lost its 'sinks' parameter")


def probe_not_importable(info):
    raise NotApplicable("vllm.x does not import here (ModuleNotFoundError: No module named 'y')")


def apply_replace(info):
    from vllm_sinks.patches.install import install

    CALLS.append("apply")
    install(Target, "fn", lambda: _ours(), "fake")
    return "replaced Target.fn"


def apply_boom(info):
    raise KeyError("boom")
