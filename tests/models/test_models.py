"""Every variant against transformers on the same weights, at TP=1, TP=2, TP=2 + SP, TP=4 (GQA
with replicated KV heads); padded and RmPad; left and right padding. fp32, max abs <= 1e-4."""

import os

import pytest

from parallel_models.testing import run_named_jobs, save_tiny_hf_model
from tests.helpers import model_checks

FWD_TOL = 1e-4
SETTINGS = {"tp1": (1, False, 1), "tp2": (2, False, 2), "tp2_sp": (2, True, 2), "tp4": (4, False, 4)}


GRADIENTS = [(2, False), (2, True)]  # (tp, sp) on 2 ranks
BIG = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
           num_key_value_heads=8, vocab_size=4096, max_shard_size="20MB")


@pytest.fixture(scope="module")
def odd_heads_model(tmp_path_factory):
    return save_tiny_hf_model(str(tmp_path_factory.mktemp("odd")), "llama", num_attention_heads=3,
                              num_key_value_heads=1, hidden_size=48)


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    return save_tiny_hf_model(str(tmp_path_factory.mktemp("big")), "llama", **BIG)


@pytest.fixture(scope="module")
def worlds(hf_models, odd_heads_model, big_model):
    """Every check of this file, grouped by world size: one spawned world per size."""
    # first in its world, so the rank's memory is that of a fresh process, as alone
    named = [(("load_memory",), 4, (model_checks.check_load_memory, (big_model, 4)))]
    for name, (tp, sp, world) in SETTINGS.items():
        named.append((("forward", name), world, (model_checks.check_forward, (hf_models, tp, sp))))
    for tp, sp in GRADIENTS:
        named.append((("gradients", tp, sp), tp,
                      (model_checks.check_gradients, (hf_models, tp, sp))))
    named.append((("bad_tp",), 2, (model_checks.check_bad_tp, (odd_heads_model, 2))))
    return run_named_jobs(named, timeout=900)


@pytest.fixture(scope="module")
def forward_results(worlds):
    return {name: worlds[("forward", name)] for name in SETTINGS}


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


@pytest.mark.parametrize("tp,sp", GRADIENTS)
def test_gradients_match_transformers(worlds, tp, sp):
    for rank, res in enumerate(worlds[("gradients", tp, sp)]):
        for family, r in res.items():
            assert r["worst_rel"] <= 1e-4, f"rank {rank} {family}: grad rel error {r['worst_rel']:.3e}"


def test_heads_not_divisible_by_tp(worlds):
    msgs = worlds[("bad_tp",)]
    assert all("num_attention_heads (3)" in m and "tensor_parallel_size (2)" in m for m in msgs), msgs


def test_load_reads_only_this_ranks_slices(worlds, big_model):
    """TP=4: the full model is 4x a shard; a rank's private memory during load stays near its
    shard and far below the full model (a full state dict would cost >= the model size)."""
    full = sum(os.path.getsize(os.path.join(big_model, f)) for f in os.listdir(big_model)
               if f.endswith(".safetensors"))
    for rank, r in enumerate(worlds[("load_memory",)]):
        assert r["shard_bytes"] * 4 >= 0.95 * full
        assert r["peak_delta"] < r["shard_bytes"] + 0.25 * full, (
            f"rank {rank}: peak {r['peak_delta'] / 2**20:.1f} MiB while loading; full model "
            f"{full / 2**20:.1f} MiB, shard {r['shard_bytes'] / 2**20:.1f} MiB")
