"""The FP8 rollout engine (``RolloutEngine(weight_dtype="fp8")``, CPU emulation) on tiny Llama
and Qwen2-MoE models, one gloo rank: the quantized linears are the decoder projections (not
the LM head), a quantized module's forward equals the quantize / dequantize math of
``inference/fp8`` applied to its weight and input; the sampled log-probs equal a fresh FP8
forward; the actor's own forward is untouched outside generate (shared weights); the FP8 copies
follow a weight change (``weights_changed``, ``update_weights``, the hybrid engine's weight
sync); continuous batching (shared
prefills) gives the static batcher's greedy tokens; the MoE experts (grouped GEMM forced on too)
run on their FP8 copies."""

import pytest
import torch

from parallel_models.testing import run_distributed


def _greedy(engine, prompts, n=1):
    from parallel_models.inference.sampling import SamplingParams

    return engine.generate(prompts, SamplingParams(max_new_tokens=8, greedy=True, n=n))


def _fresh_log_probs(model, out):
    from parallel_models.utils.padding import pack_padded_batch, unpack_to_padded

    packed = pack_padded_batch(out.sequences, out.attention_mask)
    with torch.no_grad():
        logits = model(packed.input_ids, packed.cu_seqlens, full_vocab=True).logits.float()
    logp = torch.log_softmax(unpack_to_padded(logits, packed), -1)
    P = out.prompts.shape[1]
    return logp[:, P - 1:-1].gather(-1, out.responses[..., None]).squeeze(-1) * out.response_mask


def _module_matches_quant_math(engine, name_suffix: str) -> float:
    """max |module forward - (emulated FP8 product + bias)| for the first module named so."""
    from parallel_models.inference.fp8 import emulated_matmul, quantize_weight

    _, module = next((n, m) for n, m in engine.fp8.modules if n.endswith(name_suffix))
    x = torch.randn(5, 1, module.weight.shape[1])
    expect = emulated_matmul(x.view(5, -1), quantize_weight(module.weight.detach(),
                                                            engine.fp8.granularity))
    if module.bias is not None:
        expect = expect + module.bias
    with torch.no_grad(), engine.fp8.enabled():
        got, _ = module(x)
    return (got.view(5, -1) - expect).abs().max().item()


def check_fp8_engine(llama: str, other: str, moe: str) -> dict:
    import parallel_models as pm
    from parallel_models.inference import RolloutEngine
    from parallel_models.inference.fp8 import quantize_weight
    from parallel_models.options import options_override

    pm.init_parallel(tensor_parallel_size=1)
    load = lambda p: pm.AutoModelForCausalLM.from_pretrained(p, rmpad=True, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (5, 9, 3, 7)]
    res = {}
    model = load(llama)
    ids = torch.tensor(prompts[1])
    cu = torch.tensor([0, len(ids)], dtype=torch.int32)
    with torch.no_grad():
        before = model(ids, cu, full_vocab=True).logits
    ref = _greedy(RolloutEngine(model), prompts)
    engine = RolloutEngine(model, weight_dtype="fp8", shares_training_weights=True)
    res["quantized"] = [n for n, _ in engine.fp8.modules]
    res["module_err"] = {s: _module_matches_quant_math(engine, s)
                         for s in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
    out = _greedy(engine, prompts)
    mask = out.response_mask.bool() & ref.response_mask.bool()
    res["same_tokens"] = (out.responses == ref.responses)[mask].float().mean().item()
    res["mean_logp_diff"] = (out.log_probs - ref.log_probs).abs()[mask].mean().item()
    with engine.fp8.enabled():
        res["fresh_err"] = (_fresh_log_probs(model, out) - out.log_probs).abs().max().item()
    with torch.no_grad():
        res["actor_untouched"] = torch.equal(model(ids, cu, full_vocab=True).logits, before)
    # the actor changes: the FP8 copies follow before the next generate
    qkv = engine.fp8.modules[0][1]
    with torch.no_grad():
        qkv.weight.mul_(1.5)
    engine.weights_changed()
    _greedy(engine, prompts[:1])
    res["followed_step"] = torch.equal(qkv.fp8_weight.float(), quantize_weight(
        qkv.weight.detach(), engine.fp8.granularity).data.float())
    # the hybrid engine's copy (weight sync from the actor): re-quantized after each sync
    from parallel_models.rl.rollout.hybrid import HybridRollout

    hybrid = HybridRollout(model, 1, share_weights=False, engine_options={"weight_dtype": "fp8"})
    hybrid.sync(version=1)
    _greedy(hybrid.engine, prompts[:1])
    with torch.no_grad():
        qkv.weight.mul_(0.5)
    hybrid.sync(version=2)
    _greedy(hybrid.engine, prompts[:1])
    copy_qkv = hybrid.engine.fp8.modules[0][1]
    res["followed_sync"] = torch.equal(copy_qkv.fp8_weight.float(), quantize_weight(
        qkv.weight.detach(), hybrid.engine.fp8.granularity).data.float())
    # a dedicated rollout model: FP8 always on; loading a folder re-quantizes at once
    rollout = load(llama)
    server = RolloutEngine(rollout, weight_dtype="fp8", kv_budget_tokens=96, max_rows=3)
    cont = _greedy(server, prompts, n=2)
    static = _greedy(RolloutEngine(load(llama), weight_dtype="fp8"), prompts, n=2)
    res["continuous_equal"] = torch.equal(cont.responses, static.responses)
    server.update_weights(other)
    down = next(m for n, m in server.fp8.modules if n.endswith("down_proj"))
    res["followed_load"] = torch.equal(down.fp8_weight.float(), quantize_weight(
        down.weight.detach(), server.fp8.granularity).data.float())
    # MoE: the routed and shared experts' linears are quantized; the grouped GEMM forced on
    # runs them too (the same tokens and log-probs as the per-expert loop)
    moe_model = load(moe)
    moe_engine = RolloutEngine(moe_model, weight_dtype="fp8")
    res["moe_quantized"] = [n for n, _ in moe_engine.fp8.modules]
    moe_out = _greedy(moe_engine, prompts)
    res["moe_fresh_err"] = (_fresh_log_probs(moe_model, moe_out) - moe_out.log_probs
                            ).abs().max().item()
    with options_override(moe_grouped_gemm=True):
        grouped = _greedy(moe_engine, prompts)
    res["moe_grouped_same"] = torch.equal(grouped.responses, moe_out.responses)
    res["moe_grouped_err"] = (grouped.log_probs - moe_out.log_probs).abs().max().item()
    moe_ref = _greedy(RolloutEngine(load(moe)), prompts)
    res["moe_logp_diff"] = (moe_out.log_probs - moe_ref.log_probs).abs().max().item()
    return res


@pytest.fixture(scope="module")
def results(hf_models, tmp_path_factory):
    from parallel_models.testing import save_tiny_hf_model

    root = tmp_path_factory.mktemp("fp8")
    other = save_tiny_hf_model(str(root / "other"), "llama", seed=7)
    moe = save_tiny_hf_model(str(root / "moe"), "qwen2_moe", seed=3, router_scale=30.0)
    return run_distributed(check_fp8_engine, 1, hf_models[("llama", "causal_lm")], other, moe,
                           timeout=300)[0]


def test_decoder_projections_quantized_not_the_head(results):
    names = results["quantized"]
    assert names and not any("lm_head" in n or "embed" in n for n in names)
    for proj in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        assert sum(n.endswith(proj) for n in names) == len(names) // 4


def test_module_forward_is_the_quantization_math(results):
    for proj, err in results["module_err"].items():
        assert err <= 1e-5, f"{proj}: FP8 forward vs quantize/dequantize math {err:.2e}"


def test_sampled_log_probs_are_the_fp8_models(results):
    assert results["fresh_err"] <= 1e-4
    assert 0 < results["mean_logp_diff"] < 0.1, "FP8 should move the log-probs, slightly"
    assert results["same_tokens"] >= 0.5


def test_actor_untouched_and_copies_follow_the_weights(results):
    assert results["actor_untouched"], "the shared actor's forward changed outside generate"
    assert results["followed_step"] and results["followed_load"] and results["followed_sync"]


def test_continuous_batching_same_tokens(results):
    assert results["continuous_equal"]


def test_moe_experts_quantized(results):
    names = results["moe_quantized"]
    assert any(".experts." in n and n.endswith("linear_fc1") for n in names)
    assert any("shared_expert" in n for n in names), names
    # (fp32 sums in another order between decode and a full forward can move an activation
    # across an e4m3 rounding boundary: one step of 2^-4 of that element's share, not more)
    assert results["moe_fresh_err"] <= 1e-3, results["moe_fresh_err"]
    assert results["moe_grouped_same"], "FP8 grouped GEMMs vs the experts' FP8 linears"
    assert results["moe_grouped_err"] <= 1e-5
    assert 0 < results["moe_logp_diff"] < 0.5


def test_bad_weight_dtype():
    from parallel_models.inference import RolloutEngine

    class _Model:
        head_kind, parallel_layout = "causal_lm", None

    with pytest.raises(ValueError, match="weight_dtype"):
        RolloutEngine(_Model(), weight_dtype="int8")


def test_config_fp8_turns_rollout_correction_on(caplog):
    from parallel_models.errors import ConfigError
    from parallel_models.rl.config import fp8_rollout
    from parallel_models.rl.config.ppo import load_config

    assert load_config(None, [], validate=False).actor.rollout_correction.level is None
    assert load_config(None, []).rollout.engine_options()["weight_dtype"] == "bf16"
    cfg = load_config(None, ["rollout.dtype=fp8"], validate=False)
    assert cfg.actor.rollout_correction.level == "token"
    assert cfg.actor.rollout_correction.mode == "truncate"
    assert cfg.rollout.engine_options()["weight_dtype"] == "fp8"
    kept = load_config(None, ["rollout.dtype=fp8", "actor.rollout_correction.level=sequence"],
                       validate=False)
    assert kept.actor.rollout_correction.level == "sequence"
    capped = load_config(None, ["rollout.dtype=fp8", "actor.tis_cap=3"])
    assert capped.actor.rollout_correction.level is None and capped.actor.tis_cap == 3
    fp8_rollout._warned_off = False
    with caplog.at_level("WARNING"):
        off = load_config(None, ["rollout.dtype=fp8", "actor.rollout_correction.level=null"],
                          validate=False)
        load_config(None, ["rollout.dtype=fp8", "actor.rollout_correction.level=null"],
                    validate=False)
    assert off.actor.rollout_correction.level is None
    assert sum("uncorrected" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(ConfigError, match="rollout.exact"):
        load_config(None, ["rollout.dtype=fp8", "rollout.exact=true"])
    with pytest.raises(ConfigError, match="rollout.dtype"):
        load_config(None, ["rollout.dtype=int8"])


def test_builtin_ppo_job_with_fp8_rollout_logs_the_mismatch(tmp_path):
    """CPU acceptance: the built-in job rolls out in emulated FP8; the mismatch metrics and the
    default correction's metrics are logged every step."""
    import math

    from tests.helpers.ppo_runs import run_metrics, run_ppo

    out = str(tmp_path / "fp8")
    run_ppo([f"trainer.output_dir={out}", "trainer.total_steps=2", "trainer.save_every=0",
             "trainer.loggers=[jsonl]", "trainer.save_hf_at_end=false", "rollout.dtype=fp8",
             "algorithm.adv_estimator=grpo", "algorithm.kl_in_reward=false", "data.batch_size=4",
             "actor.mini_batch_size=8", "actor.ppo_epochs=1"])
    rows = run_metrics(out)
    assert len(rows) == 2
    for r in rows:
        assert math.isfinite(r["actor/pg_loss"])
        # FP8 rollout vs the trainer's float forward: a mismatch that shows, and stays small
        assert 0 < r["rollout/logprob_diff_mean"] < 0.5, r
        assert 0 < r["rollout/k3_kl"] < 0.5 and math.isfinite(r["rollout/logprob_diff_max"])
        assert math.isfinite(r["rollout_corr/weight_mean"]), r
