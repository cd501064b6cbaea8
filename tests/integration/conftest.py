from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tt_cache_dir(tmp_path_factory):
    """One tokenizer cache for the session: the default BPE is trained once, then loaded by every run."""
    return tmp_path_factory.mktemp("torchtitan_cache")
