"""Reward model (issue 6): re-tokenization between different tokenizers, scores vs transformers'
SequenceClassification at TP=1, TP=2 and PP=2 (fp32, <= 1e-4), the same-tokenizer fast path
without decoding, token-level placement (PPO, left-, right-padded, packed), truncation policy and
metric, empty responses, offload bookkeeping, and the trainer's entry point. Issue 21: a reward
model saved with its own tokenizer is scored with that tokenizer when loaded by path, the fast
path works with an RM folder without tokenizer files, and ``layers_per_stage`` splits a 5-layer
RM unevenly over PP=2.

All multi-rank checks run in one spawn of 2 gloo ranks (TP=1 as 2 data-parallel replicas, then
TP=2, TP=2 + sequence parallel, then PP=2); the references are computed here, from the original
texts, with transformers.
"""

import pytest
import torch

from parallel_models.rl.rewards.inputs import place_scores, split_prompt_response
from parallel_models.rl.rewards.tokenizer import same_tokenizer
from parallel_models.testing import run_distributed, save_tiny_hf_model
from tests.helpers import reward_model_checks as rc

TOL = 1e-4
SETTINGS = [(1, 1, False), (2, 1, False), (2, 1, True), (1, 2, False)]  # (tp, pp, seq. parallel)
SETTING_IDS = ["tp1", "tp2", "tp2_sp", "pp2"]
LAYOUTS = ("ppo", "left", "right", "packed", "packed_mask")


def _hf_scores(path, seqs):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.tensor([model(torch.tensor([s])).logits[0, 0].item() for s in seqs])


def _expected_rm_ids(tok, with_template: bool):
    """The RM tokenization built from the original texts (not from decoded actor ids)."""
    out = []
    for i, s in enumerate(rc.SAMPLES):
        if with_template:
            conv = list(s["messages"]) if "messages" in s else \
                [{"role": "user", "content": s["prompt"]}]
            conv.append({"role": "assistant", "content": s["response"]})
            text = tok.apply_chat_template(conv, tokenize=False)
            out.append(list(tok(text, add_special_tokens=False)["input_ids"]))
        else:
            prompt = rc.ACTOR_CHAT_PROMPT_1 if "messages" in s else s["prompt"]
            out.append(list(tok(prompt + s["response"])["input_ids"]))
    return out


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from parallel_models.tokenizer import build_builtin_tokenizer

    root = tmp_path_factory.mktemp("rm")
    actor_tok = build_builtin_tokenizer()
    chat_tok, plain_tok = rc.build_rm_chat_tokenizer(), rc.build_rm_plain_tokenizer()
    paths = {"actor_tok": str(root / "actor_tok"), "rm_chat": str(root / "rm_chat"),
             "rm_plain": str(root / "rm_plain"), "tok_plain": str(root / "plain_tok")}
    actor_tok.save_pretrained(paths["actor_tok"])
    # a Llama RM (GQA, llama3 rope) with its own ChatML BPE tokenizer in its folder; a Qwen2 RM
    # (qkv bias) whose plain tokenizer is given by path
    save_tiny_hf_model(paths["rm_chat"], "llama", head="value", seed=3)
    chat_tok.save_pretrained(paths["rm_chat"])
    save_tiny_hf_model(paths["rm_plain"], "qwen2", head="value", seed=4)
    plain_tok.save_pretrained(paths["tok_plain"])
    # issue 21: a Qwen2 RM saved with its own lowercasing BPE; a 5-layer RM for uneven PP splits
    bpe_tok = rc.build_rm_lowercase_bpe_tokenizer()
    paths["rm_bpe"], paths["rm_uneven"] = str(root / "rm_bpe"), str(root / "rm_uneven")
    save_tiny_hf_model(paths["rm_bpe"], "qwen2", head="value", seed=6)
    bpe_tok.save_pretrained(paths["rm_bpe"])
    save_tiny_hf_model(paths["rm_uneven"], "llama", head="value", seed=7, num_hidden_layers=5)

    rows = rc.actor_ids(actor_tok)
    batches = rc.make_batches(rows)
    want_ids = {"chat": _expected_rm_ids(chat_tok, True),
                "plain": _expected_rm_ids(plain_tok, False),
                "bpe": _expected_rm_ids(bpe_tok, False)}
    lengths = sorted(len(x) for x in want_ids["chat"])
    trunc = [lengths[len(lengths) // 2]]  # some rows over, some not
    want = {name: _hf_scores(paths[f"rm_{name}"], ids) for name, ids in want_ids.items()}
    actor_full = [p + r for p, r, _ in rows]
    want["fast"] = _hf_scores(paths["rm_chat"], actor_full)
    want["fast_plain"] = _hf_scores(paths["rm_plain"], actor_full)
    want["uneven"] = _hf_scores(paths["rm_uneven"], actor_full)
    trunc_want = {}
    for m in trunc:
        for policy in ("left", "right"):
            # the ChatML tokenizer adds no BOS: "left" keeps the last m tokens
            ids = [x if len(x) <= m else (x[len(x) - m:] if policy == "left" else x[:m])
                   for x in want_ids["chat"]]
            trunc_want[(policy, m)] = {"ids": ids, "scores": _hf_scores(paths["rm_chat"], ids),
                                       "count": sum(len(x) > m for x in want_ids["chat"])}
    results = run_distributed(rc.run_checks, 2, paths, batches, SETTINGS, trunc, timeout=300)
    return {"paths": paths, "rows": rows, "batches": batches, "want_ids": want_ids, "want": want,
            "trunc": trunc_want, "results": results, "actor_tok": actor_tok, "chat_tok": chat_tok,
            "bpe_tok": bpe_tok}


def _ranks(env, setting):
    return [(rank, r[setting]) for rank, r in enumerate(env["results"])]


def test_the_two_tokenizers_really_differ(env):
    """Guards the premise: other vocabularies (ids of the same text differ) and templates."""
    actor, chat = env["actor_tok"], env["chat_tok"]
    assert not same_tokenizer(actor, chat)
    assert actor("what")["input_ids"] != chat("what", add_special_tokens=False)["input_ids"]
    assert actor.chat_template != chat.chat_template
    assert env["want_ids"]["chat"] != [p + r for p, r, _ in env["rows"]]


@pytest.mark.parametrize("setting", SETTINGS, ids=SETTING_IDS)
@pytest.mark.parametrize("rm", ["chat", "plain"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_scores_match_transformers_on_rm_tokenized_conversation(env, setting, rm, layout):
    for rank, res in _ranks(env, setting):
        assert res["ids"][(rm, layout)] == env["want_ids"][rm], f"rank {rank}: RM token ids differ"
        got = res["scores"][(rm, layout)]
        assert got.dtype == torch.float32 and got.device.type == "cpu" and got.shape == (5,)
        err = (got - env["want"][rm]).abs().max().item()
        assert err <= TOL, f"{setting} rank {rank} {rm}/{layout}: max abs err {err:.3e}"


@pytest.mark.parametrize("setting", SETTINGS, ids=SETTING_IDS)
def test_different_tokenizers_are_decoded(env, setting):
    for rank, res in _ranks(env, setting):
        assert res["same_tokenizer_chat"] is False and res["same_tokenizer_plain"] is False
        assert res["decodes"]["chat"] > 0 and res["decodes"]["plain"] > 0


@pytest.mark.parametrize("setting", SETTINGS, ids=SETTING_IDS)
def test_same_tokenizer_fast_path_scores_ids_without_decoding(env, setting):
    for rank, res in _ranks(env, setting):
        assert res["fast_path"] is True
        for who, calls in res["fast_calls"].items():
            assert sum(calls.values()) == 0, f"rank {rank}: {who} tokenizer was used: {calls}"
        for layout, got in res["fast_scores"].items():
            err = (got - env["want"]["fast"]).abs().max().item()
            assert err <= TOL, f"{setting} rank {rank} {layout}: {err:.3e}"


def _expected_positions(env, layout):
    """Where each row's reward must land (None for an empty response), computed from the rows."""
    rows, b = env["rows"], env["batches"][layout]
    out = []
    cu = 0
    for i, (p, r, _) in enumerate(rows):
        if layout == "ppo":
            pos = (i, len(r) - 1)
        elif layout == "left":
            pos = (i, b["sequences"].shape[1] - 1)
        elif layout == "right":
            pos = (i, len(p) + len(r) - 1)
        else:
            pos = (cu + len(p) + len(r) - 1,)
        cu += len(p) + len(r)
        out.append(pos if r else None)
    return out


@pytest.mark.parametrize("setting", SETTINGS, ids=SETTING_IDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_token_level_reward_on_last_valid_response_token(env, setting, layout):
    positions = _expected_positions(env, layout)
    assert positions[2] is None and positions[4] is not None  # empty vs only-EOS response
    for rank, res in _ranks(env, setting):
        tl = res["token_level"][("chat", layout)]
        scores = res["scores"][("chat", layout)]
        b = env["batches"][layout]
        shape = b["input_ids"].shape if layout.startswith("packed") else b["response_mask"].shape
        assert tl.shape == shape and tl.dtype == torch.float32
        want = torch.zeros(shape)
        for i, pos in enumerate(positions):
            if pos is not None:
                want[pos] = scores[i]
        assert torch.equal(tl, want), f"{setting} rank {rank} {layout}"


@pytest.mark.parametrize("setting", SETTINGS, ids=SETTING_IDS)
def test_empty_response_is_scored(env, setting):
    for rank, res in _ranks(env, setting):
        for rm in ("chat", "plain"):
            got = res["scores"][(rm, "ppo")]
            assert torch.isfinite(got).all()
            for i in (2, 4):  # no response token / only the stop token: both score "" answers
                assert abs(got[i] - env["want"][rm][i]) <= TOL


@pytest.mark.parametrize("setting", SETTINGS, ids=SETTING_IDS)
@pytest.mark.parametrize("policy", ["left", "right"])
def test_truncation_policy_and_metric(env, setting, policy):
    for (pol, m), want in env["trunc"].items():
        if pol != policy:
            continue
        assert 0 < want["count"] < 5
        for rank, res in _ranks(env, setting):
            got = res[("trunc", policy, m)]
            assert got["ids"] == want["ids"], f"rank {rank}: {policy}-truncated ids differ"
            assert all(len(x) <= m for x in got["ids"])
            assert got["metrics"]["reward/truncated"] == want["count"]
            assert got["total"] == want["count"]  # one score() call; encode_batch counts nothing
            err = (got["scores"] - want["scores"]).abs().max().item()
            assert err <= TOL, f"{setting} rank {rank} {policy}: {err:.3e}"


@pytest.mark.parametrize("setting", SETTINGS, ids=SETTING_IDS)
def test_offload_bookkeeping(env, setting):
    for rank, res in _ranks(env, setting):
        o = res["offload"]
        assert o["initially_offloaded"] is False
        assert o["n_tensors"] == o["n_params"] + o["n_buffers"] and o["n_buffers"] > 0
        assert o["moved_bytes"] > 0 and o["offloaded_flag"] is True
        assert o["second_offload_bytes"] == 0
        assert o["on_compute_device_after_offload"] == 0
        assert o["same_storage_after_offload"] == 0, "a tensor kept its compute-device storage"
        assert o["pinned_after_offload"] in (None, True)
        assert o["offloaded_after_score"] is True
        assert o["score_while_offloaded_err"] == 0.0
        assert o["onloaded_flag"] is False and o["bit_identical_after_onload"]
        assert o["same_parameter_objects"] and o["resident_after_score"]
        assert o["auto_offloaded_at_setup"] and o["auto_offloaded_after_score"]
        assert o["auto_err"] == 0.0


@pytest.mark.parametrize("setting", SETTINGS, ids=SETTING_IDS)
def test_from_config_and_parallel_size_must_match_actor(env, setting):
    tp, pp, sp = setting
    for rank, res in _ranks(env, setting):
        assert res["sequence_parallel"] == [sp] * len(res["sequence_parallel"])
        assert res["n_chunks_layers"] == [2 // pp]  # PP=2: one of the two layers per stage
        assert (res["from_config_scores"] - env["want"]["chat"]).abs().max() <= TOL
        # reward.offload=true acts on CUDA only (automatic there, resident on a CPU machine)
        assert res["from_config_offloaded"] is torch.cuda.is_available()
        bad_tp, bad_pp = res["bad_tp_error"], res["bad_pp_error"]
        assert bad_tp and f"reward.tensor_parallel_size={tp + 1}" in bad_tp and f"({tp})" in bad_tp
        assert bad_pp and f"reward.pipeline_parallel_size={pp + 1}" in bad_pp


# ---- issue 21: sharp edges that gave silently wrong results ------------------------------
def test_premise_auto_tokenizer_ignores_the_saved_bpe(env):
    """transformers 5's AutoTokenizer builds a Qwen2Tokenizer for the Qwen2 folder and encodes
    otherwise than the saved tokenizer: what RewardModel(path) used to score with."""
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(env["paths"]["rm_bpe"])
    text = "Hello world"
    assert auto(text)["input_ids"] != env["bpe_tok"](text)["input_ids"]
    assert _expected_rm_ids(auto, False) != env["want_ids"]["bpe"]


@pytest.mark.parametrize("setting", SETTINGS, ids=SETTING_IDS)
def test_rm_loaded_by_path_scores_with_its_saved_tokenizer(env, setting):
    for rank, res in _ranks(env, setting):
        got = res["bpe"]
        assert got["same_tokenizer"] is False
        assert got["ids"] == env["want_ids"]["bpe"], f"rank {rank}: not the saved tokenizer's ids"
        err = (got["scores"] - env["want"]["bpe"]).abs().max().item()
        assert err <= TOL, f"{setting} rank {rank}: max abs err {err:.3e}"


@pytest.mark.parametrize("setting", SETTINGS, ids=SETTING_IDS)
def test_fast_path_with_rm_folder_without_tokenizer_files(env, setting):
    import os

    assert not any(name.startswith(("tokenizer", "vocab", "special_tokens"))
                   for name in os.listdir(env["paths"]["rm_plain"]))
    for rank, res in _ranks(env, setting):
        notok = res["notok"]
        assert notok["tokenizer_is_actor"] and notok["ids_only_tokenizer"] is None
        for layout, got in notok["with_actor"].items():
            err = (got - env["want"]["fast_plain"]).abs().max().item()
            assert err <= TOL, f"{setting} rank {rank} {layout}: {err:.3e}"
        assert (notok["ids_only"] - env["want"]["fast_plain"]).abs().max() <= TOL
        msg = notok["undecided_error"]
        assert msg and env["paths"]["rm_plain"] in msg and "same_tokenizer=True" in msg


@pytest.mark.parametrize("setting", SETTINGS, ids=SETTING_IDS)
def test_layers_per_stage_uneven_split_scores_like_pp1(env, setting):
    """A 5-layer RM: PP=2 with layers_per_stage=[3, 2] (rank 0 layers 0-2, rank 1 layers 3-4)
    scores like the same ranks at PP=1 and like transformers."""
    _, pp, _ = setting
    for rank, res in _ranks(env, setting):
        got = res["uneven"]
        want_layers = [[0, 1, 2, 3, 4]] if pp == 1 else [[[0, 1, 2]], [[3, 4]]][rank]
        assert got["layers"] == want_layers, f"rank {rank}: {got['layers']}"
        err = (got["scores"] - env["want"]["uneven"]).abs().max().item()
        assert err <= TOL, f"{setting} rank {rank}: vs transformers {err:.3e}"
        pp1 = env["results"][rank][(1, 1, False)]["uneven"]["scores"]
        err = (got["scores"] - pp1).abs().max().item()
        assert err <= 1e-5, f"{setting} rank {rank}: vs PP=1 {err:.3e}"
        # reward.layers_per_stage and reward.same_tokenizer through RewardModel.from_config
        assert got["from_config_layers"] == want_layers
        assert torch.equal(got["from_config_scores"], got["scores"])
        assert "layers_per_stage" in got["bad_split_error"]


def test_load_tokenizer_uses_the_saved_tokenizer_and_checks_it(tmp_path):
    import json

    from tokenizers import Tokenizer
    from transformers import Qwen2Config

    from parallel_models.config import ConfigError
    from parallel_models.tokenizer import PROBE_TEXT, load_tokenizer

    folder = tmp_path / "bpe"
    Qwen2Config(vocab_size=251).save_pretrained(folder)
    rc.build_rm_lowercase_bpe_tokenizer().save_pretrained(folder)
    saved = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok = load_tokenizer(str(folder))
    for text in ("Hello world", PROBE_TEXT):
        assert tok(text)["input_ids"] == saved.encode(text).ids
    # a tokenizer_config naming a class that rebuilds another pipeline: a clear error, no quiet
    # re-encoding
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "Qwen2Tokenizer"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=rf"^{tmp_path}/bpe: .*Qwen2Tokenizer.*does not match"):
        load_tokenizer(str(folder))
    cfg["tokenizer_class"] = "NoSuchTokenizer"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="NoSuchTokenizer"):
        load_tokenizer(str(folder))
    with pytest.raises(ConfigError, match="cannot load the tokenizer from"):
        load_tokenizer(str(tmp_path / "missing"))


# ---- single-process unit checks ------------------------------------------------------------------
def test_place_scores_layouts():
    scores = torch.tensor([1.0, 2.0, 3.0])
    # right-padded responses [N, R]; row 1 empty
    rmask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]])
    out = place_scores(scores, {"response_mask": rmask})
    assert torch.equal(out, torch.tensor([[0, 1.0, 0], [0, 0, 0], [0, 0, 3.0]]))
    # left-padded full-width mask
    lmask = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 0], [0, 1, 1, 1]])
    out = place_scores(scores, {"response_mask": lmask})
    assert out[0, 3] == 1.0 and out[2, 3] == 3.0 and out.sum() == 4.0
    # packed: response by prompt_lengths, or by a packed response_mask
    packed = {"input_ids": torch.arange(9), "cu_seqlens": torch.tensor([0, 3, 5, 9]),
              "prompt_lengths": torch.tensor([1, 2, 2])}
    out = place_scores(scores, packed)
    assert torch.equal(out.nonzero().flatten(), torch.tensor([2, 8])) and out[8] == 3.0
    packed_mask = {"input_ids": torch.arange(9), "cu_seqlens": torch.tensor([0, 3, 5, 9]),
                   "response_mask": torch.tensor([0, 1, 0, 0, 0, 0, 0, 1, 1])}
    out = place_scores(scores, packed_mask)
    assert out[1] == 1.0 and out[8] == 3.0 and out.sum() == 4.0


def test_split_prompt_response_layouts_agree():
    from parallel_models.tokenizer import build_builtin_tokenizer

    rows = rc.actor_ids(build_builtin_tokenizer())
    want = ([p for p, _, _ in rows], [r for _, r, _ in rows])
    for layout, batch in rc.make_batches(rows).items():
        assert split_prompt_response(batch) == want, layout
    bad = rc.make_batches(rows)["ppo"]
    bad["prompt_lengths"] = bad["prompt_lengths"] + 1
    with pytest.raises(ValueError, match=r"row \d+: "):
        split_prompt_response(bad)


def test_same_tokenizer_detection(tmp_path):
    from transformers import AutoTokenizer

    from parallel_models.tokenizer import build_builtin_tokenizer

    a = build_builtin_tokenizer()
    a.save_pretrained(tmp_path / "a")
    b = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert same_tokenizer(a, a) and same_tokenizer(a, b)
    b.chat_template = rc.CHATML  # same vocabulary, another chat template
    assert not same_tokenizer(a, b)
    assert not same_tokenizer(a, rc.build_rm_plain_tokenizer())
