import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from transformer_fa.attention import selection  # noqa: E402

ENV_VARS = selection.ENV_VARS


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Each test starts with none of the selection's variables (NVTE_*, the flash kernel
    family) and an empty backend cache."""
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    selection.clear_cache()
    yield
    selection.clear_cache()
