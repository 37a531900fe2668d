"""Launch settings of the split-KV decode kernel (inference/split_kv_config.py): the option
``decode_kernel_config`` (or its environment variable) wins over the table by shape, which wins
over the default; malformed values are refused naming the variable; the automatic split size is
at least one tile."""

import pytest

from parallel_models.errors import ConfigError
from parallel_models.inference import split_kv_config
from parallel_models.inference.split_kv_attention import split_size
from parallel_models.inference.split_kv_config import DEFAULT, LaunchConfig, launch_config
from parallel_models.options import options_override

ENV = "PARALLEL_MODELS_DECODE_KERNEL_CONFIG"


def test_env_then_table_then_default(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("PARALLEL_MODELS_DECODE_SPLIT", raising=False)
    assert launch_config(64, 384) == DEFAULT
    big = LaunchConfig(32, 8, 3)
    long_rows = LaunchConfig(128, 4, 4, 512)
    monkeypatch.setattr(split_kv_config, "TUNED", [(128, 0, big), (0, 2048, long_rows)])
    assert launch_config(64, 384) == DEFAULT
    assert launch_config(256, 384) == big
    assert launch_config(256, 4096) == long_rows  # the last entry reached wins
    assert split_size(256, 8, 4096, "cpu") == 512
    with options_override(decode_kernel_config="32,4,2"):
        assert launch_config(256, 4096) == LaunchConfig(32, 4, 2)
    monkeypatch.setenv(ENV, "16,2,1")
    assert launch_config(256, 4096) == LaunchConfig(16, 2, 1)
    assert LaunchConfig(16, 2, 1, 64).as_env() == "16,2,1,64"
    monkeypatch.setenv("PARALLEL_MODELS_DECODE_SPLIT", "32")
    assert split_size(256, 8, 4096, "cpu") == 32


def test_automatic_split_is_at_least_one_tile(monkeypatch):
    monkeypatch.delenv("PARALLEL_MODELS_DECODE_SPLIT", raising=False)
    monkeypatch.setenv(ENV, "128,4,2")
    assert split_size(512, 8, 64, "cpu") == 128  # one split of 64 positions, a tile of 128
    monkeypatch.setenv(ENV, "16,4,2")
    assert split_size(1, 1, 64, "cpu") == 16  # 8 splits (4 "SMs" twice over) of 8 positions


@pytest.mark.parametrize("value,match", [("64,4", "expected"), ("a,b,c", "expected"),
                                         ("48,4,2", "block_n"), ("64,3,2", "num_warps"),
                                         ("64,4,0", "num_stages"), ("64,4,2,100", "split")])
def test_malformed_values_are_refused(monkeypatch, value, match):
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ConfigError, match=f"PARALLEL_MODELS_DECODE_KERNEL_CONFIG.*{match}"):
        launch_config(64, 384)
    monkeypatch.delenv(ENV)
    with pytest.raises(ConfigError, match=f"decode_kernel_config.*{match}"):
        with options_override(decode_kernel_config=value):
            launch_config(64, 384)


def test_exact_mode_never_takes_unrotated_q_k(monkeypatch):
    """In exact mode the pool cache decodes with exact mode's attention kernel (the one of prefill
    and training), which takes rotated q / k: the attention module must then apply RoPE itself
    (found on the GPU: with the split-KV kernel's in-kernel RoPE merged, exact-mode decode ran
    without RoPE and rollout log-probs left the training ones by up to 0.4)."""
    import torch

    from parallel_models.inference import pool_cache

    from parallel_models.inference import split_kv_attention

    monkeypatch.delenv("PARALLEL_MODELS_DECODE_FUSE_ROPE", raising=False)
    cache = pool_cache.PoolKVCache(1, 16, 2, 8, 2, 16, torch.float32, "cpu")
    cache.decode_kernel, cache.decoding = "triton", True  # as on CUDA with Triton
    monkeypatch.setattr(split_kv_attention, "rope_supported", lambda *args: True)
    assert cache.fuses_rope()
    monkeypatch.setattr(pool_cache.exact, "enabled", lambda: True)
    assert not cache.fuses_rope()
