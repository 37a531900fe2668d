import importlib.util
import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    # the Triton kernels' tests run them in Triton's CPU interpreter, which has to be chosen
    # before anything imports triton (a kernel module imported before, e.g. by an earlier test
    # module or the forkserver's preload, fails in the interpreter: "Cannot call @triton.jit'd
    # outside of the scope of a kernel")
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["tests.helpers.early_runs",  # long PPO runs started when collection ends
                  "tests.helpers.background_lane"]  # subprocess-bound tests, forked then


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """Tiny random HF checkpoints built locally: Llama (GQA, llama3 rope) and Qwen2 (qkv bias,
    tied embeddings), as CausalLM and as SequenceClassification (num_labels=1)."""
    from parallel_models.testing import save_tiny_hf_model

    root = tmp_path_factory.mktemp("hf")
    out = {}
    for family in ("llama", "qwen2"):
        for head in ("causal_lm", "value"):
            out[(family, head)] = save_tiny_hf_model(str(root / f"{family}_{head}"), family,
                                                     head=head, seed=1)
    return out


@pytest.fixture(scope="session")
def hybrid_reference(tmp_path_factory):
    """The 3-step PPO run at PP=1, TP=1 on one rank that the hybrid-engine layouts
    (tests/test_hybrid_ppo*.py) must reproduce; run once for both files."""
    from tests.helpers.hybrid_ppo_runs import metrics_at

    return metrics_at(tmp_path_factory.mktemp("hybrid_ref"), 1, [], "pp1")


@pytest.fixture(scope="session")
def checkpoint_models(tmp_path_factory):
    """The checkpoint tests' models, saved and converted once for tests/test_checkpoint*.py."""
    from tests.helpers.checkpoint_setup import build_models

    return build_models(tmp_path_factory.mktemp("ckpt"))
