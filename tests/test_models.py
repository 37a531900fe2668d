"""Every variant against transformers on the same weights, at TP=1, TP=2, TP=2 + SP, TP=4 (GQA
with replicated KV heads); padded and RmPad; left and right padding. fp32, max abs <= 1e-4."""

import pytest

from parallel_models.testing import run_distributed, save_tiny_hf_model
from tests import model_checks

FWD_TOL = 1e-4
SETTINGS = {"tp1": (1, False, 1), "tp2": (2, False, 2), "tp2_sp": (2, True, 2), "tp4": (4, False, 4)}


@pytest.fixture(scope="module")
def forward_results(hf_models):
    results = {}
    for name, (tp, sp, world) in SETTINGS.items():
        results[name] = run_distributed(model_checks.check_forward, world, hf_models, tp, sp)
    return results


KEYS = [f"{fam}-{head}-{layout}-{side}" for fam in ("llama", "qwen2") for head in ("causal_lm", "value")
        for layout in ("padded", "rmpad") for side in ("left", "right")]


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("key", KEYS)
def test_forward_matches_transformers(forward_results, setting, key):
    for rank, res in enumerate(forward_results[setting]):
        err = res["errors"][key]
        assert err <= FWD_TOL, f"{setting} rank {rank} {key}: max abs error {err:.3e}"


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s != "tp1"])
def test_vocab_parallel_logits_are_the_rank_slice(forward_results, setting):
    for rank, res in enumerate(forward_results[setting]):
        for fam in ("llama", "qwen2"):
            err = res["errors"][f"{fam}-causal_lm-padded-right-vocab-slice"]
            assert err <= FWD_TOL, f"{setting} rank {rank} {fam}: {err:.3e}"


@pytest.mark.parametrize("setting", ["tp2", "tp2_sp", "tp4"])
def test_values_identical_across_tp(forward_results, setting):
    base = forward_results["tp1"][0]["values"]
    for rank, res in enumerate(forward_results[setting]):
        for key, values in res["values"].items():
            err = (values - base[key]).abs().max().item()
            assert err <= 1e-5, f"{setting} rank {rank} {key}: {err:.3e} vs TP=1"


@pytest.mark.parametrize("tp,sp", [(2, False), (2, True)])
def test_gradients_match_transformers(hf_models, tp, sp):
    results = run_distributed(model_checks.check_gradients, tp, hf_models, tp, sp)
    for rank, res in enumerate(results):
        for family, r in res.items():
            assert r["worst_rel"] <= 1e-4, f"rank {rank} {family}: grad rel error {r['worst_rel']:.3e}"


def test_heads_not_divisible_by_tp(tmp_path):
    path = save_tiny_hf_model(str(tmp_path / "odd"), "llama", num_attention_heads=3,
                              num_key_value_heads=1, hidden_size=48)
    msgs = run_distributed(model_checks.check_bad_tp, 2, path, 2)
    assert all("num_attention_heads (3)" in m and "tensor_parallel_size (2)" in m for m in msgs), msgs


def test_load_reads_only_this_ranks_slices(tmp_path):
    """TP=4: the full model is 4x a shard; a rank's private memory during load stays near its
    shard and far below the full model (a full state dict would cost >= the model size)."""
    path = save_tiny_hf_model(str(tmp_path / "big"), "llama", hidden_size=512,
                              intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
                              num_key_value_heads=8, vocab_size=4096, max_shard_size="20MB")
    full = sum(f.stat().st_size for f in (tmp_path / "big").glob("*.safetensors"))
    results = run_distributed(model_checks.check_load_memory, 4, path, 4)
    for rank, r in enumerate(results):
        assert r["shard_bytes"] * 4 >= 0.95 * full
        assert r["peak_delta"] < r["shard_bytes"] + 0.25 * full, (
            f"rank {rank}: peak {r['peak_delta'] / 2**20:.1f} MiB while loading; full model "
            f"{full / 2**20:.1f} MiB, shard {r['shard_bytes'] / 2**20:.1f} MiB")
