import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from transformer_fa.attention import selection  # noqa: E402

ENV_VARS = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN", "NVTE_DEBUG",
            "NVTE_DEBUG_LEVEL", "NVTE_ALLOW_NONDETERMINISTIC_ALGO")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Each test starts with no NVTE_* variables and an empty backend cache."""
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    selection.clear_cache()
    yield
    selection.clear_cache()
