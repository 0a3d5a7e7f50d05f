"""Test-only helpers, kept out of the wheel: Triton launcher fakes and the OpenAI server check."""
