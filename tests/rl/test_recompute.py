"""Activation recomputation (parallel_models.llama.layers.recompute, ``actor.recompute``): the
gradients with ``full`` (each decoder layer run again in the backward) and ``selective`` (the
core attention run again) equal those without recomputation bit for bit, in fp32 on gloo ranks
at TP=1, TP=2 (with sequence parallel) and PP=2, through the pipeline schedule's
forward_backward over packed microbatches of uneven lengths; the recompute really happens
(layer / attention calls counted); a no-grad forward does not recompute; the config setting
reaches the roles' models and megatron-core's TransformerConfig; MoE refuses full."""

import pytest
import torch

from parallel_models.testing import run_distributed

MODES = ("none", "selective", "full")


def _grads_per_mode(path: str, tp: int, pp: int) -> dict:
    import parallel_models as pm
    from parallel_models.llama.layers import recompute
    from tests.helpers.moe_aux_pp_checks import _padded_batch
    from tests.helpers.pipeline_checks import _ce_loss_fn, _microbatches_packed

    pm.init_parallel(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                     sequence_parallel=tp > 1)
    cls = pm.get_model_class(pm.registry.architecture_of(path), "causal_lm", rmpad=True,
                             pp=pp > 1)
    calls = {"layer": 0, "attention": 0}
    real_attention = recompute.varlen_causal_attention

    def counted_attention(*args, **kwargs):
        calls["attention"] += 1
        return real_attention(*args, **kwargs)

    recompute.varlen_causal_attention = counted_attention
    out = {}
    for mode in MODES:
        chunks = pm.build_pipeline_chunks(cls, path, dtype=torch.float32) if pp > 1 else \
            [cls.from_pretrained(path, dtype=torch.float32)]
        recompute.set_recompute(chunks, mode)
        first = chunks[0].model.layers[0]
        first.register_forward_pre_hook(lambda *_: calls.__setitem__("layer", calls["layer"] + 1))
        ids, mask = _padded_batch(chunks[0].config.vocab_size, seed=3)
        mbs = [dict(mb, full_vocab=True) for mb in _microbatches_packed(ids, mask, 4)]
        for c in calls:
            calls[c] = 0
        metrics = pm.pipeline.forward_backward(chunks, mbs, _ce_loss_fn)
        grads = {f"{i}.{n}": p.grad.clone() for i, c in enumerate(chunks)
                 for n, p in c.named_parameters() if p.grad is not None}
        out[mode] = {"grads": grads, "loss": [float(m["loss_sum"]) for m in metrics],
                     "calls": dict(calls), "layers": sum(len(c.model.layers) for c in chunks),
                     "granularity": chunks[0].mp_config.recompute_granularity}
        for c in calls:
            calls[c] = 0
        pm.pipeline.forward_only(chunks, mbs[:1])  # no grad: nothing recomputed
        out[mode]["no_grad_calls"] = dict(calls)
    return out


@pytest.fixture(scope="module")
def runs(hf_models):
    path = hf_models[("llama", "causal_lm")]
    return {(tp, pp): run_distributed(_grads_per_mode, tp * pp, path, tp, pp, timeout=600)
            for tp, pp in ((1, 1), (2, 1), (1, 2))}


@pytest.mark.parametrize("layout", [(1, 1), (2, 1), (1, 2)])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_gradients_equal_without_recompute_bit_for_bit(runs, layout, mode):
    for rank in runs[layout]:
        base, other = rank["none"], rank[mode]
        assert base["grads"] and base["grads"].keys() == other["grads"].keys()
        for name, g in base["grads"].items():
            assert torch.equal(g, other["grads"][name]), f"{mode}: {name} differs"
        assert base["loss"] == other["loss"]


@pytest.mark.parametrize("layout", [(1, 1), (2, 1), (1, 2)])
def test_recompute_runs_again_in_the_backward(runs, layout):
    """Layer calls: 4 microbatch forwards, + 4 recomputes with full. Calls of the attention
    kernel through the selective path: each layer's forward and its recompute."""
    for rank in runs[layout]:
        none, selective, full = (rank[m]["calls"] for m in MODES)
        layers = rank["none"]["layers"]
        assert none == {"layer": 4, "attention": 0}
        assert full == {"layer": 8, "attention": 0}
        assert selective == {"layer": 4, "attention": 2 * 4 * layers}
        # a no-grad forward of one microbatch recomputes nothing
        assert rank["none"]["no_grad_calls"] == rank["full"]["no_grad_calls"] == \
            {"layer": 1, "attention": 0}
        assert rank["selective"]["no_grad_calls"] == {"layer": 1, "attention": layers}


def test_selective_and_full_at_context_parallel_2_bit_for_bit(hf_models):
    """CP = 2 (2 ranks, through the schedule's CP gradient reduction): selective recomputes the
    CP attention (K/V all-gather + this rank's chunks) in the backward, and its gradients and
    full's equal those without recomputation bit for bit."""
    from tests.helpers.context_parallel_checks import recompute_grads

    for rank in run_distributed(recompute_grads, 2, hf_models[("llama", "causal_lm")], 2,
                                timeout=600):
        # the tiny llama's 2 layers x 2 microbatches, each in the forward and its recompute
        calls = {m: rank[m]["recomputed_attention_calls"] for m in MODES}
        assert calls == {"none": 0, "selective": 2 * 2 * 2, "full": 0}, calls
        base = rank["none"]["grads"]
        for mode in ("selective", "full"):
            assert base.keys() == rank[mode]["grads"].keys()
            for name, g in base.items():
                assert torch.equal(g, rank[mode]["grads"][name]), f"CP=2 {mode}: {name} differs"


def test_megatron_config_carries_the_granularity(runs):
    rank = runs[(1, 1)][0]
    assert [rank[m]["granularity"] for m in MODES] == [None, "selective", "full"]


def test_config_setting_and_moe_refusal(hf_models):
    from parallel_models.errors import ConfigError
    from parallel_models.llama.layers.recompute import set_recompute
    from parallel_models.rl.config import load_config

    cfg = load_config(overrides=["actor.recompute=full", "critic.recompute=selective"])
    assert cfg.actor.recompute == "full" and cfg.critic.recompute == "selective"
    assert load_config().actor.recompute == "none"
    with pytest.raises(Exception, match="recompute"):
        load_config(overrides=["actor.recompute=some"])

    class Moe:
        config = type("C", (), {"is_moe": True})()

    with pytest.raises(ConfigError, match="MoE"):
        set_recompute(Moe(), "full")
    with pytest.raises(ConfigError, match="none | selective | full"):
        set_recompute([], "everything")
