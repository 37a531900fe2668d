"""GPU-only tests (marker ``gpu``): the CUDA paths the CPU suite cannot reach.

Every test here is skipped without CUDA, so the CPU suite (CI) passes over them. Run on a GPU host:
``python -m pytest -q -m gpu tests/gpu`` (results of the last run: docs/PERFORMANCE.md).
"""

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_models(tmp_path_factory):
    """Small random HF checkpoints (bigger than the CPU suite's so the GPU kernels see real shapes):
    Llama with GQA and llama3 rope, Qwen2 with qkv bias and tied embeddings."""
    from parallel_models.testing import save_tiny_hf_model

    root = tmp_path_factory.mktemp("gpu_hf")
    shapes = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=1001)
    return {fam: save_tiny_hf_model(str(root / fam), fam, seed=0, **shapes)
            for fam in ("llama", "qwen2")}


@pytest.fixture(scope="module")
def single_rank():
    """TP=1 process groups on this process's GPU (torch.distributed as a single process)."""
    import parallel_models as pm

    pm.init_parallel(tensor_parallel_size=1)
    yield
    pm.destroy_parallel()
