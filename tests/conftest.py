"""Test-wide environment: set before anything imports triton, transformers or matplotlib."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # Triton kernels run on CPU tensors
os.environ.setdefault("HF_HUB_OFFLINE", "1")     # nothing may touch the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SERVELAB_SHARED", REPO.parent / "shared"))
TRACES = SHARED / "traces"


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    """The real public traces of ../shared/traces (CI has ../shared beside the checkout)."""
    if not TRACES.is_dir():
        raise FileNotFoundError(f"shared traces not found at {TRACES}; set SERVELAB_SHARED")
    return TRACES


@pytest.fixture(scope="module")
def torch_one_thread():
    """Torch on one thread for a module (deterministic CPU timings and results); a module
    opts in with `pytestmark = pytest.mark.usefixtures("torch_one_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
