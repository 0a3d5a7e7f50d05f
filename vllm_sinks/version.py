"""The package version, in a module of its own: anything may import it without importing the plugin's
entry point (``vllm_sinks/__init__.py``) and what that pulls in. pyproject.toml states it too;
tests/unit/test_changelog.py keeps the two and CHANGELOG.md's newest heading equal."""

__version__ = "0.1.0"
