"""Checkpoints (issue 4): the HF saver, hf2mcore / mcore2hf, megatron-core loading our output and
us loading megatron-core's, TP resharding. Bad input: tests/checkpoint/test_checkpoint_errors.py; the record
format, interrupted conversions and the command line: tests/checkpoint/test_checkpoint_records.py; the models
and helpers they share: tests/helpers/checkpoint_setup.py.

Round trips compare every tensor bit for bit, dtype included. Multi-rank work is batched into
three spawned runs.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from parallel_models.testing import TensorDictReader, run_distributed, run_distributed_jobs
from tests.helpers import checkpoint_checks as cc
from tests.helpers.checkpoint_setup import (HEAD, LOGIT_TOL, MODELS, RUN_TIMEOUT, assert_bit_exact,
                                    convert, expect_error, load_all, no_leftovers, to_hf)


@pytest.fixture(scope="module")
def env(checkpoint_models):
    return checkpoint_models


# ---- weight rules: pure transforms, one CPU ----------------------------------------------------------------



@pytest.mark.parametrize("family,overrides", [
    ("llama", dict(attention_bias=True, mlp_bias=True)), ("llama", dict(num_key_value_heads=1)),
    ("qwen2", {})], ids=["llama-biases", "llama-kv1", "qwen2"])
@pytest.mark.parametrize("head", ["causal_lm", "value"])
def test_weight_rules_are_inverse_pairs(family, overrides, head):
    """For every mapping and TP in 1, 2, 4: merge(shard) and from_mcore(to_mcore) give the HF
    tensors back bit for bit; mcore_rows locates each HF row in to_mcore's layout; the TP pieces
    megatron-core is told about tile to_mcore's tensor (replica 0 once, others equal)."""
    from parallel_models.config import ModelConfig
    from parallel_models.llama.checkpoint_utils import LLAMA
    from parallel_models.testing import tiny_hf_config

    config = ModelConfig.from_hf(tiny_hf_config(family, **overrides))
    gen = torch.Generator().manual_seed(0)
    for m in LLAMA.mappings(config, head):
        hf = {n: torch.randn(s, generator=gen) for n, s in zip(m.hf, m.rule.hf_shapes(config))}
        parts = [hf[n] for n in m.hf]
        fused = m.rule.to_mcore(parts, config)
        assert tuple(fused.shape) == m.rule.mcore_shape(config), m.ours
        assert all(torch.equal(a, b) for a, b in zip(m.rule.from_mcore(fused, config), parts))
        for comp, t in enumerate(parts):
            rows = m.rule.mcore_rows(comp, 0, t.shape[0], config)
            assert torch.equal(torch.cat([fused[a:b] for a, b in rows]), t), (m.ours, comp)
        for tp in (1, 2, 4):
            shards = [m.rule.shard(TensorDictReader(hf), m.hf, config, tp, r) for r in range(tp)]
            back = m.rule.merge(shards, config)
            assert all(torch.equal(a, b) for a, b in zip(back, parts)), (m.ours, tp)
            tiled = None  # the megatron tensor the pieces describe (vocab: padded rows)
            for r, shard in enumerate(shards):
                for p in m.rule.mcore_pieces(shard, config, tp, r):
                    if p.axis is None:
                        assert torch.equal(p.tensor, fused), (m.ours, tp)
                        continue
                    size = p.tensor.shape[p.axis]
                    if tiled is None:
                        shape = list(fused.shape)
                        shape[p.axis] = size * p.count
                        tiled = torch.full(shape, float("nan"))
                    target = tiled.narrow(p.axis, p.index * size, size)
                    if p.replica == 0:
                        assert bool(target.isnan().all()), (m.ours, tp, "two main copies")
                        target.copy_(p.tensor)
                    else:  # a replica: equal to its main copy
                        assert torch.equal(p.tensor, fused.narrow(p.axis, p.index * size, size))
            if tiled is not None:
                n = fused.shape[0]
                assert torch.equal(tiled[:n], fused), (m.ours, tp)
                assert not bool(tiled[n:].any()), (m.ours, tp)  # vocab padding rows: zero


# ---- HF -> hf2mcore -> mcore2hf -> HF --------------------------------------------------------------
@pytest.mark.parametrize("name", list(MODELS))
def test_hf2mcore_mcore2hf_is_bit_exact(env, name):
    out = str(env["root"] / f"{name}.back")
    stats = to_hf(env["mcore"][name], out, max_shard_size="60KB")
    assert_bit_exact(env["src"][name], out)
    assert stats["tensors"] == len(load_all(out))
    index = json.loads(open(os.path.join(out, "model.safetensors.index.json")).read())
    assert len(set(index["weight_map"].values())) > 1  # size-limited shards
    assert no_leftovers(out)


def test_local_spec_names_round_trip(env):
    from parallel_models.llama.checkpoint_utils import LLAMA, McoreCheckpoint

    ck = McoreCheckpoint(env["mcore"]["llama.local"], LLAMA)
    assert ck.layer_spec == "local"
    assert "decoder.layers.input_layernorm.weight" in ck.tensors
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" not in ck.tensors
    out = str(env["root"] / "llama.local.back")
    to_hf(env["mcore"]["llama.local"], out)
    assert_bit_exact(env["src"]["llama"], out)


def test_hf2mcore_layout_is_megatron_core_s(env):
    """Keys, stacking and the QKV grouping as megatron-core 0.16's GPTModel saves them."""
    from parallel_models.llama.checkpoint_utils import LLAMA, QWEN2, McoreCheckpoint

    ck = McoreCheckpoint(env["mcore"]["llama"], LLAMA)
    src = load_all(env["src"]["llama"])
    qkv = ck.read_region("decoder.layers.self_attention.linear_qkv.weight", 1, 0, 128)
    q, k, v = (src[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    d, qpg = 16, 2  # head_dim, q heads per KV group (4 heads, 2 KV heads)
    want = torch.cat([q[:qpg * d], k[:d], v[:d], q[qpg * d:], k[d:], v[d:]])
    assert torch.equal(qkv, want)
    fc1 = ck.read_region("decoder.layers.mlp.linear_fc1.weight", 0, 0, 192)
    assert torch.equal(fc1, torch.cat([src["model.layers.0.mlp.gate_proj.weight"],
                                       src["model.layers.0.mlp.up_proj.weight"]]))
    assert tuple(ck.tensors["decoder.layers.self_attention.linear_proj.weight"].size) == (2, 64, 64)
    extra = {k for k in ck.metadata.state_dict_metadata if "_extra_state" in k}
    assert len(extra) == 4 * 2 and "decoder.layers.mlp.linear_fc2._extra_state/shard_1_2" in extra
    assert "output_layer.weight" in ck.tensors
    tied = McoreCheckpoint(env["mcore"]["qwen2"], QWEN2)
    assert "output_layer.weight" not in tied.tensors  # tied: absent, as megatron-core saves it
    assert "decoder.layers.self_attention.linear_qkv.bias" in tied.tensors
    value = McoreCheckpoint(env["mcore"]["llama_value"], LLAMA)
    assert value.head_kind == "value"
    assert tuple(value.tensors["output_layer.weight"].size) == (1, 64)
    info = json.loads(open(os.path.join(env["mcore"]["qwen2"], "mcore_config.json")).read())
    tc = info["transformer_config"]
    assert (tc["num_query_groups"], tc["add_qkv_bias"], tc["add_bias_linear"]) == (2, True, False)
    assert info["gpt_model"]["share_embeddings_and_output_weights"] is True
    assert info["dtype"] == "bfloat16" and not info["notes"]


def test_hf2mcore_value_from_a_causal_lm(env, tmp_path):
    """--value on a causal LM: a critic initialized from it (fresh value head, no LM head)."""
    from parallel_models.llama.checkpoint_utils import LLAMA, McoreCheckpoint

    mc, out = str(tmp_path / "mc"), str(tmp_path / "hf")
    convert(env["src"]["llama"], mc, value=True)
    ck = McoreCheckpoint(mc, LLAMA)
    assert ck.head_kind == "value" and tuple(ck.tensors["output_layer.weight"].size) == (1, 64)
    to_hf(mc, out)
    cfg = json.loads(open(os.path.join(out, "config.json")).read())
    assert cfg["architectures"] == ["LlamaForSequenceClassification"]
    src, got = load_all(env["src"]["llama"]), load_all(out)
    assert set(got) == set(src) - {"lm_head.weight"} | {"score.weight"}
    assert all(torch.equal(src[k], got[k]) for k in got if k != "score.weight")
    assert 0 < got["score.weight"].std() < 0.05


# ---- our models at TP=2: save_pretrained, save_mcore, from_pretrained(mcore folder) ---------------------
def _tp2_saves_job(env):
    root = env["root"]
    jobs = []
    for name, src in env["src"].items():
        head = HEAD[name]
        jobs += [{"src": src, "head": head, "out": str(root / f"{name}.tp2.hf"), "kind": "hf",
                  "shard": "60KB"},
                 {"src": src, "head": head, "out": str(root / f"{name}.tp2.mcore"), "kind": "mcore"},
                 {"src": env["mcore"][name], "head": head, "out": str(root / f"{name}.mcore.tp2.hf"),
                  "kind": "hf"}]
    busy = root / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("keep")
    # busy: saving into a non-empty folder must fail
    return cc.save_roundtrips, (jobs, 2), {"busy": str(busy)}


@pytest.mark.parametrize("name", list(MODELS))
def test_from_pretrained_tp2_save_pretrained_is_bit_exact(env, tp2_saves, name):
    out = str(env["root"] / f"{name}.tp2.hf")
    assert_bit_exact(env["src"][name], out)
    index = json.loads(open(os.path.join(out, "model.safetensors.index.json")).read())
    assert len(set(index["weight_map"].values())) > 1


@pytest.mark.parametrize("name", list(MODELS))
def test_from_pretrained_of_hf2mcore_output_at_tp2_is_bit_exact(env, tp2_saves, name):
    for rank, res in enumerate(tp2_saves):
        report = res[str(env["root"] / f"{name}.mcore.tp2.hf")]["report"]
        assert not report["missing"] and not report["initialized"], (rank, report)
    assert_bit_exact(env["src"][name], str(env["root"] / f"{name}.mcore.tp2.hf"))


@pytest.mark.parametrize("name", list(MODELS))
def test_save_mcore_at_tp2_then_mcore2hf_is_bit_exact(env, tp2_saves, name):
    mc = str(env["root"] / f"{name}.tp2.mcore")
    # (common.pt too with megatron-core 0.16; 0.19 skips it when the common state is empty)
    assert {"metadata.json", ".metadata", "config.json", "mcore_config.json"} <= set(os.listdir(mc))
    out = str(env["root"] / f"{name}.tp2.mcore.hf")
    to_hf(mc, out)
    assert_bit_exact(env["src"][name], out)


def test_saved_folders_load_in_transformers(env, tp2_saves):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    root = env["root"]
    value_out = str(root / "qwen2_value.tp2.hf")
    cfg = json.loads(open(os.path.join(value_out, "config.json")).read())
    assert cfg["architectures"] == ["Qwen2ForSequenceClassification"] and cfg["dtype"] == "bfloat16"
    assert len(cfg["id2label"]) == 1
    model = AutoModelForSequenceClassification.from_pretrained(value_out)
    assert model.config.num_labels == 1 and model.score.weight.shape == (1, 64)
    lm_out = str(root / "llama.tp2.hf")
    assert isinstance(AutoModelForCausalLM.from_pretrained(lm_out).lm_head, torch.nn.Linear)
    for out in (lm_out, str(root / "llama.back"), str(root / "llama.mcore.tp2.hf")):
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            assert os.path.isfile(os.path.join(out, f)), (out, f)


def test_saving_into_a_non_empty_folder_fails_on_every_rank(env, tp2_saves):
    busy = env["root"] / "busy"
    for rank, res in enumerate(tp2_saves):
        for msg in res["busy_errors"]:
            assert "not empty" in msg or "cannot write" in msg, (rank, msg)
    assert "not empty" in tp2_saves[0]["busy_errors"][0]
    assert sorted(os.listdir(busy)) == ["keep.txt"] and no_leftovers(str(busy))


# ---- TP=2 x PP=2 ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tp2_pp2_saves(env):
    root = env["root"]
    jobs = [{"src": src, "head": HEAD[name], "out": str(root / f"{name}.tp2pp2.hf"), "kind": "hf"}
            for name, src in env["src"].items()]
    jobs += [{"src": env["mcore"][name], "head": HEAD[name], "out": str(root / f"{name}.tp2pp2.mcore"),
              "kind": "mcore"} for name in ("llama", "qwen2", "qwen2_value")]
    # tied embeddings (Qwen2): a drifted head copy on the last stage makes both savers raise
    jobs += [{"src": env["src"]["qwen2"], "head": "causal_lm", "kind": kind, "perturb_tied": True,
              "out": str(root / f"qwen2.tp2pp2.tied.{kind}")} for kind in ("hf", "mcore")]
    return run_distributed(cc.pp_save_roundtrips, 4, jobs, 2, 2, timeout=RUN_TIMEOUT)


@pytest.mark.parametrize("name", list(MODELS))
def test_from_pretrained_tp2_pp2_save_pretrained_is_bit_exact(env, tp2_pp2_saves, name):
    assert_bit_exact(env["src"][name], str(env["root"] / f"{name}.tp2pp2.hf"))


@pytest.mark.parametrize("kind", ["hf", "mcore"])
def test_tied_embedding_copies_that_differ_are_refused(env, tp2_pp2_saves, kind):
    """Issue 21: Qwen2 (tie_word_embeddings) at TP=2 x PP=2. A save writes only stage 0's
    embedding; when the last stage's head copy differs (here on TP rank 0 only), every rank
    raises naming the stages and nothing is written; unperturbed, the same save succeeds and
    matches the source."""
    out = str(env["root"] / f"qwen2.tp2pp2.tied.{kind}")
    for rank in range(4):
        errors = tp2_pp2_saves[rank][out + ":errors"]
        assert len(errors) == 2
        for msg in errors:
            assert "tied embeddings differ between pipeline stage 0" in msg, (rank, msg)
            assert "stage 1 (its copy as the LM head)" in msg, (rank, msg)
    assert "TP rank 0: stage 0 sum" in tp2_pp2_saves[0][out + ":errors"][0]
    if kind == "mcore":
        to_hf(out, out + ".hf")
        out = out + ".hf"
    assert_bit_exact(env["src"]["qwen2"], out)
    assert no_leftovers(out)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen2_value"])
def test_mcore_at_tp2_pp2_round_trip_is_bit_exact(env, tp2_pp2_saves, name):
    """from_pretrained(hf2mcore folder) and save_mcore at TP=2 x PP=2 (tied embeddings: the last
    stage's copy is not saved), then mcore2hf."""
    out = str(env["root"] / f"{name}.tp2pp2.mcore.hf")
    to_hf(str(env["root"] / f"{name}.tp2pp2.mcore"), out)
    assert_bit_exact(env["src"][name], out)


# ---- megatron-core GPTModel ------------------------------------------------------------------------------
def _load_cases(env, names):
    src, mc = env["src"], env["mcore"]
    table = {"llama": (mc["llama"], src["llama"], True),
             "qwen2": (mc["qwen2.fp32"], src["qwen2"], True),
             "llama-local-spec": (mc["llama.local"], src["llama"], False),
             "llama.save_mcore": (str(env["root"] / "llama.tp2.mcore"), src["llama"], True),
             "llama_kv1.save_mcore": (str(env["root"] / "llama_kv1.tp2.mcore"), src["llama_kv1"],
                                      True)}
    return [{"name": n, "mcore": table[n][0], "hf": table[n][1], "keys_map": table[n][2]}
            for n in names]


def _megatron_tp2_job(env):
    from parallel_models import ModelConfig
    from parallel_models.llama.checkpoint_utils.megatron_format import mcore_config_dict

    saves = []
    for name in ("llama", "qwen2"):
        cfg = ModelConfig.from_hf(env["src"][name])
        saves.append({"name": name, "hf": env["src"][name],
                      "mcore_json": mcore_config_dict(cfg, head_kind="causal_lm",
                                                      dtype=torch.float32, layer_spec="local"),
                      "out": str(env["root"] / f"{name}.megatron_tp2")})
    loads = _load_cases(env, ["llama", "qwen2", "llama-local-spec"])
    return cc.megatron_checks, (loads, saves, 2)


@pytest.fixture(scope="module")
def two_ranks(env):
    """The TP=2 saves and megatron-core's TP=2 checks in one 2-rank world."""
    saves, megatron = run_distributed_jobs([_tp2_saves_job(env), _megatron_tp2_job(env)], 2,
                                           timeout=2 * RUN_TIMEOUT)
    return {"saves": saves, "megatron": megatron}


@pytest.fixture(scope="module")
def tp2_saves(two_ranks):
    return two_ranks["saves"]


@pytest.fixture(scope="module")
def megatron_tp2(two_ranks):
    return two_ranks["megatron"]


@pytest.fixture(scope="module")
def megatron_tp1(env, tp2_saves):
    loads = _load_cases(env, ["llama", "qwen2", "llama.save_mcore", "llama_kv1.save_mcore"])
    return run_distributed(cc.megatron_checks, 1, loads, [], 1, timeout=RUN_TIMEOUT)


@pytest.mark.parametrize("name", ["llama", "qwen2", "llama-local-spec"])
def test_megatron_tp2_loads_hf2mcore_output(megatron_tp2, name):
    for rank, res in enumerate(megatron_tp2):
        err = res["loads"][name]
        assert err <= LOGIT_TOL, f"rank {rank} {name}: max |logits - transformers| = {err:.3e}"


@pytest.mark.parametrize("name", ["llama", "qwen2", "llama.save_mcore", "llama_kv1.save_mcore"])
def test_megatron_tp1_loads_our_checkpoints(megatron_tp1, name):
    """hf2mcore output, and save_mcore output written at TP=2 (resharded to TP=1 on load; the
    one-KV-head model's QKV was saved per head, being replicated over the TP ranks)."""
    err = megatron_tp1[0]["loads"][name]
    assert err <= LOGIT_TOL, f"{name}: max |logits - transformers| = {err:.3e}"


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_megatron_saved_tp2_checkpoint_through_mcore2hf(env, megatron_tp2, name):
    for rank, res in enumerate(megatron_tp2):  # the weights set in megatron are right
        assert res["saves"][name] <= LOGIT_TOL, (rank, res["saves"][name])
    mc = str(env["root"] / f"{name}.megatron_tp2")
    assert "config.json" not in os.listdir(mc)  # megatron's own: weights only
    out = str(env["root"] / f"{name}.megatron_tp2.hf")
    to_hf(mc, out, hf_config=env["src"][name])
    src_cfg = json.loads(open(os.path.join(env["src"][name], "config.json")).read())
    assert json.loads(open(os.path.join(out, "config.json")).read())["vocab_size"] == src_cfg["vocab_size"]
    from parallel_models import ModelConfig

    ids = cc.token_batch(ModelConfig.from_hf(env["src"][name]).vocab_size)
    err = (cc.hf_logits(out, ids) - cc.hf_logits(env["src"][name], ids)).abs().max().item()
    assert err <= LOGIT_TOL
    assert_bit_exact(env["src"][name], out, upcast=name == "qwen2")  # saved in fp32


def test_mcore2hf_needs_a_config(env, tmp_path, megatron_tp2):
    out = str(tmp_path / "out")
    expect_error(lambda: to_hf(str(env["root"] / "llama.megatron_tp2"), out), out, "--hf-config")
    expect_error(lambda: to_hf(str(env["src"]["llama"]), out), out, "metadata.json")
