import os
from pathlib import Path

import pytest
import torch.distributed as dist

# Codec tests run tiny models on loopback, where timing noise would make the per-bucket fallback
# (which sends a bucket plainly when compressing it costs more) flip codecs off at random. The
# fallback has its own tests, which turn it on explicitly. Spawned ranks inherit this.
os.environ.setdefault("LIGHTNING_GRADCOMP_FALLBACK", "0")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def shared_data() -> Path:
    """The real data sets kept beside the repository; skips when they are absent (a user's clone)."""
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not present")
    return SHARED_DATA
