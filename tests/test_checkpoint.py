"""Checkpoints (issue 4): the HF saver, hf2mcore / mcore2hf, megatron-core loading our output and
us loading megatron-core's, TP resharding, bad input.

Models: Llama (GQA, llama3 rope in the form megatron-core expresses, fp32, source in several
safetensors shards), Qwen2 (qkv bias, tied embeddings, bf16), their value (sequence-classification)
versions, and a Llama with one KV head (replicated over the TP ranks). Round trips compare every
tensor bit for bit, dtype included. Multi-rank work is batched into three spawned runs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from parallel_models.testing import (TensorDictReader, run_distributed, run_distributed_jobs,
                                     save_tiny_hf_model)
from tests import checkpoint_checks as cc

RUN_TIMEOUT = 240
LOGIT_TOL = 1e-4
MEGATRON_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
LLAMA = dict(rope_scaling=MEGATRON_ROPE, max_position_embeddings=16384)
MODELS = {  # name: (family, head, dtype, overrides)
    "llama": ("llama", "causal_lm", None, LLAMA),
    "qwen2": ("qwen2", "causal_lm", torch.bfloat16, {}),
    "llama_value": ("llama", "value", None, LLAMA),
    "qwen2_value": ("qwen2", "value", torch.bfloat16, {}),
    "llama_kv1": ("llama", "causal_lm", None, dict(LLAMA, num_key_value_heads=1)),
}
HEAD = {name: spec[1] for name, spec in MODELS.items()}


def load_all(folder: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(folder, f), "pt") as h:
                out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def assert_bit_exact(src: str, got: str, upcast: bool = False) -> None:
    a, b = load_all(src), load_all(got)
    assert sorted(a) == sorted(b), f"tensor names differ: {sorted(set(a) ^ set(b))}"
    for name in a:
        x, y = (a[name].float(), b[name]) if upcast else (a[name], b[name])
        assert x.dtype == y.dtype, f"{name}: dtype {y.dtype}, source {x.dtype}"
        assert torch.equal(x, y), f"{name}: values differ"


def no_leftovers(path: str) -> bool:
    parent, base = os.path.split(os.path.abspath(path))
    return not any(n.startswith(f".{base}.tmp-") for n in os.listdir(parent))


def convert(src, out, **kw):
    from conversion.hf2mcore import convert_hf_to_mcore

    kw.setdefault("format", "flat")  # these tests read the dist checkpoint files in `out` itself
    return convert_hf_to_mcore(src, out, progress=False, **kw)


def to_hf(src, out, **kw):
    from conversion.mcore2hf import convert_mcore_to_hf

    return convert_mcore_to_hf(src, out, progress=False, **kw)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    src = {}
    for i, (name, (family, head, dtype, kw)) in enumerate(MODELS.items()):
        shard = "100KB" if name == "llama" else None
        src[name] = save_tiny_hf_model(str(root / name), family, head=head, seed=10 + i,
                                       dtype=dtype, max_shard_size=shard, **kw)
    # tokenizer files travel with the weights
    for f, text in (("tokenizer_config.json", '{"model_max_length": 64}'),
                    ("tokenizer.json", '{"version": "1.0"}')):
        (root / "llama" / f).write_text(text)
    mc = {}
    for name, path in src.items():
        mc[name] = str(root / f"{name}.mcore")
        convert(path, mc[name])
    mc["llama.local"] = str(root / "llama.local.mcore")
    convert(src["llama"], mc["llama.local"], layer_spec="local")
    mc["qwen2.fp32"] = str(root / "qwen2.fp32.mcore")
    convert(src["qwen2"], mc["qwen2.fp32"], dtype="fp32")
    return {"root": root, "src": src, "mcore": mc}


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


# ---- bad input -------------------------------------------------------------------------------------------
def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _expect_error(fn, out, *needles):
    from parallel_models import CheckpointError, ConfigError

    with pytest.raises((CheckpointError, ConfigError)) as info:
        fn()
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, msg
    assert not os.path.exists(out) and no_leftovers(out)
    return msg


def test_hf2mcore_missing_shard_named_in_index(env, tmp_path):
    bad = _copy(env["src"]["llama"], tmp_path / "bad")
    os.remove(os.path.join(bad, "model-00002-of-00004.safetensors"))
    _expect_error(lambda: convert(bad, str(tmp_path / "out")), str(tmp_path / "out"),
                  "model-00002-of-00004.safetensors", "missing")


def test_hf2mcore_truncated_safetensors(env, tmp_path):
    bad = _copy(env["src"]["qwen2"], tmp_path / "bad")
    path = os.path.join(bad, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    _expect_error(lambda: convert(bad, str(tmp_path / "out")), str(tmp_path / "out"),
                  "model.safetensors", "cannot read")


def test_hf2mcore_unknown_architecture(env, tmp_path, capsys):
    from conversion.hf2mcore import main

    bad = _copy(env["src"]["qwen2"], tmp_path / "bad")
    cfg = json.loads(open(os.path.join(bad, "config.json")).read())
    cfg["architectures"] = ["MistralForCausalLM"]
    open(os.path.join(bad, "config.json"), "w").write(json.dumps(cfg))
    out = str(tmp_path / "out")
    assert main(["--hf-path", bad, "--output", out, "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "unsupported architecture 'MistralForCausalLM'" in err and "LlamaForCausalLM" in err
    assert not os.path.exists(out) and no_leftovers(out)


def test_hf2mcore_into_non_empty_folder(env, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("keep")
    from parallel_models import CheckpointError

    with pytest.raises(CheckpointError, match="not empty"):
        convert(env["src"]["llama"], str(out))
    with pytest.raises(CheckpointError, match="not empty"):
        to_hf(env["mcore"]["llama"], str(out))
    assert sorted(os.listdir(out)) == ["keep.txt"] and no_leftovers(str(out))


def _without_tensor(src: str, dst: str, drop: str) -> str:
    """A real dist checkpoint that lacks one tensor: ``src`` rewritten without ``drop``."""
    from parallel_models.llama.checkpoint_utils import LLAMA, McoreCheckpoint
    from parallel_models.llama.checkpoint_utils.dcp import ChunkItem, write_dist_checkpoint
    from parallel_models.llama.checkpoint_utils.megatron_format import (extra_state_items,
                                                                       write_megatron_files)

    ck = McoreCheckpoint(src, LLAMA)
    items = [ChunkItem(key, tuple(c.offsets), tuple(c.sizes), tuple(md.size), md.properties.dtype,
                       lambda k=key, c=c: ck._chunk(k, c))
             for key, md in ck.tensors.items() if key != drop for c in md.chunks]
    os.makedirs(dst)
    write_dist_checkpoint(dst, items, extra_state_items(ck.config.num_layers))
    write_megatron_files(dst)
    for f in ("config.json", "mcore_config.json"):
        shutil.copyfile(os.path.join(src, f), os.path.join(dst, f))
    return dst


def test_mcore2hf_dist_checkpoint_missing_a_tensor(env, tmp_path):
    bad = _without_tensor(env["mcore"]["llama"], str(tmp_path / "bad"),
                          "decoder.layers.mlp.linear_fc2.weight")
    out = str(tmp_path / "out")
    _expect_error(lambda: to_hf(bad, out), out, "decoder.layers.mlp.linear_fc2.weight",
                  "model.layers.0.mlp.down_proj.weight")


def test_mcore2hf_missing_or_truncated_chunk_file(env, tmp_path):
    bad = _copy(env["mcore"]["llama"], tmp_path / "bad")
    os.remove(os.path.join(bad, "__0_0.distcp"))
    _expect_error(lambda: to_hf(bad, str(tmp_path / "out")), str(tmp_path / "out"),
                  "__0_0.distcp", "missing")
    bad2 = _copy(env["mcore"]["qwen2"], tmp_path / "bad2")
    path = os.path.join(bad2, "__0_0.distcp")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    _expect_error(lambda: to_hf(bad2, str(tmp_path / "out2")), str(tmp_path / "out2"),
                  "truncated")


def test_mcore2hf_needs_a_config(env, tmp_path, megatron_tp2):
    out = str(tmp_path / "out")
    _expect_error(lambda: to_hf(str(env["root"] / "llama.megatron_tp2"), out), out, "--hf-config")
    _expect_error(lambda: to_hf(str(env["src"]["llama"]), out), out, "metadata.json")


def test_mcore_metadata_is_not_unpickled_blindly(env, tmp_path):
    """A crafted ``.metadata`` cannot run code: only DCP's own classes are allowed."""
    import pickle

    bad = _copy(env["mcore"]["qwen2"], tmp_path / "bad")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with open(os.path.join(bad, ".metadata"), "wb") as f:
        pickle.dump(Evil(), f)
    out = str(tmp_path / "out")
    _expect_error(lambda: to_hf(bad, out), out, "not allowed")
    assert not marker.exists()


def _records(folder: str):
    """(key, raw bytes) of every chunk record of a dist checkpoint, located by DCP's index."""
    from parallel_models.llama.checkpoint_utils.dcp import read_dcp_metadata

    md = read_dcp_metadata(folder)
    for index, info in sorted(md.storage_data.items(), key=lambda kv: (kv[1].relative_path,
                                                                         kv[1].offset)):
        with open(os.path.join(folder, info.relative_path), "rb") as f:
            f.seek(info.offset)
            yield index.fqn, f.read(info.length)


def test_hf2mcore_records_carry_crc32(env):
    """Every record hf2mcore writes (range-copied from safetensors or assembled) has a CRC32 in
    each zip member that Python's zipfile verifies, and torch.load reads it."""
    import io
    import zipfile

    n = 0
    for name in ("llama", "qwen2", "qwen2.fp32"):  # verbatim copies, and dtype-converted ones
        for key, raw in _records(env["mcore"][name]):
            zf = zipfile.ZipFile(io.BytesIO(raw))
            assert zf.testzip() is None, f"{name}: {key}: bad CRC32"
            assert all(i.CRC != 0 for i in zf.infolist() if i.file_size), f"{name}: {key}: no CRC32"
            torch.load(io.BytesIO(raw), weights_only=True)
            n += 1
    assert n > 50


def test_records_streamed_through_small_buffers_match_torch_save(tmp_path):
    """A record's data and its CRC32 fields crossing write-buffer boundaries: the file holds the
    records torch.save writes (CRC32 checked by zipfile, values by torch.load), only the
    serialization id differs."""
    import io
    import zipfile

    from parallel_models.llama.checkpoint_utils.dcp import tensor_filler, write_record
    from parallel_models.llama.checkpoint_utils.direct_io import (RangeReader, WriteBehind,
                                                                 segment_filler)
    from parallel_models.llama.checkpoint_utils.torch_record import Placeholder

    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(37, 101, generator=gen), torch.randn(5000, generator=gen).bfloat16(),
               torch.zeros(0, 3), torch.arange(3, dtype=torch.int64), torch.randn(3, 1999)]
    src = str(tmp_path / "src.bin")  # the last tensor's bytes, copied verbatim as segments
    with open(src, "wb") as f:
        f.write(b"x" * 123 + tensors[-1].numpy().tobytes())
    wb, reader, path = WriteBehind(size=8192, count=2), RangeReader(), str(tmp_path / "out.bin")
    out, spans = wb.open(path), []
    for i, t in enumerate(tensors):
        start = out.tell()
        if i == len(tensors) - 1:
            write_record(out, Placeholder().tensor(t.shape, t.dtype),
                         segment_filler(reader, [(src, 123, 4000), (src, 4123, t.nbytes - 4000)]))
        else:
            write_record(out, t, tensor_filler(t))
        spans.append((start, out.tell()))
    out.close()
    wb.finish()
    reader.close()
    assert wb.crc_bytes == sum(t.nbytes for t in tensors)
    data = open(path, "rb").read()
    for t, (a, b) in zip(tensors, spans):
        raw = data[a:b]
        assert zipfile.ZipFile(io.BytesIO(raw)).testzip() is None
        assert torch.equal(torch.load(io.BytesIO(raw), weights_only=True), t)
        ref = io.BytesIO()
        torch.save(t, ref)
        ref = ref.getvalue()
        differ = [k for k in range(len(ref)) if ref[k] != raw[k]]
        sid = zipfile.ZipFile(io.BytesIO(ref)).getinfo("archive/.data/serialization_id")
        assert len(ref) == len(raw) and all(k >= sid.header_offset for k in differ)


def test_interrupted_conversion_leaves_nothing(env, tmp_path, monkeypatch):
    from parallel_models.llama.checkpoint_utils.direct_io import RangeReader

    calls = {"n": 0}
    original = RangeReader.read_into  # what copies the tensors from the safetensors files

    def flaky(self, *args):
        calls["n"] += 1
        if calls["n"] == 7:
            raise KeyboardInterrupt
        return original(self, *args)

    monkeypatch.setattr(RangeReader, "read_into", flaky)
    out = str(tmp_path / "out")
    with pytest.raises(KeyboardInterrupt):
        convert(env["src"]["llama"], out)
    assert calls["n"] == 7 and not os.path.exists(out) and no_leftovers(out)


# ---- command line ------------------------------------------------------------------------------------------
def _script(name):
    exe = shutil.which(name)
    return [exe] if exe else [sys.executable, "-m", f"conversion.{name}"]


def test_cli_help():
    from conversion import hf2mcore, mcore2hf

    for mod, flags in ((hf2mcore, ["--hf-path", "--output", "--dtype", "--layer-spec", "--value"]),
                       (mcore2hf, ["--mcore-path", "--output", "--hf-config"])):
        text = mod.build_parser().format_help()
        assert all(f in text for f in flags), text
        with pytest.raises(SystemExit) as info:
            mod.main(["--help"])
        assert info.value.code == 0


def test_cli_end_to_end(env, tmp_path):
    mc, hf = str(tmp_path / "mc"), str(tmp_path / "hf")
    run = subprocess.run(_script("hf2mcore") + ["--hf-path", env["src"]["qwen2"], "--output", mc,
                                                "--dtype", "fp32"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "hf2mcore: 26 tensors" in run.stdout and "GB/s" in run.stdout, run.stdout
    assert "hf2mcore:" in run.stderr  # the tqdm bar
    run = subprocess.run(_script("mcore2hf") + ["--mcore-path", mc, "--output", hf],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert_bit_exact(env["src"]["qwen2"], hf, upcast=True)
    run = subprocess.run(_script("mcore2hf") + ["--mcore-path", mc, "--output", hf],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "error:" in run.stderr and "not empty" in run.stderr
    assert "Traceback" not in run.stderr
