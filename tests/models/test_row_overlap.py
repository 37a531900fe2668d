"""Row-parallel GEMM/all-reduce overlap (parallel_models/llama/layers/row_overlap.py): at TP=2
(gloo, fp32) the chunked forward and its backward equal megatron-core's unchunked
RowParallelLinear on a tiny Llama: logits and every parameter gradient, k = 2 and 3, token
counts not divisible by k, with and without sequence parallel."""

import pytest
import torch

from parallel_models.testing import run_distributed

TOL = 1e-6


def _tp2_chunked_vs_plain(sequence_parallel, tokens):
    import parallel_models as pm
    from parallel_models.config import ModelConfig
    from parallel_models.llama.layers import row_overlap
    from parallel_models.testing import tiny_hf_config
    from parallel_models.utils.vocab_parallel import log_probs_from_packed_logits

    pm.init_parallel(tensor_parallel_size=2, sequence_parallel=sequence_parallel)
    try:
        config = ModelConfig.from_hf(tiny_hf_config("llama"))
        model = pm.LlamaForCausalLMRmPad(config, dtype=torch.float32)
        gen = torch.Generator().manual_seed(7)  # the same weights on both ranks
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.2, generator=gen)
        ids = torch.randint(0, config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1))
        cu = torch.tensor([0, tokens // 2 + 1, tokens], dtype=torch.int32)

        calls = []
        apply = row_overlap.ChunkedRowParallelMatmul.apply
        row_overlap.ChunkedRowParallelMatmul.apply = lambda *a: calls.append(a[2]) or apply(*a)

        def run(k):
            assert row_overlap.set_tp_overlap_chunks(model, k) == 2 * config.num_layers
            model.zero_grad(set_to_none=True)
            logits = model(ids, cu).logits
            loss = -log_probs_from_packed_logits(logits, ids, cu).sum() / tokens
            loss.backward()
            return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

        want_logits, want_grads = run(0)
        assert not calls
        out = {}
        for k in (2, 3):
            logits, grads = run(k)
            out[f"k{k}/chunked_calls"] = len(calls)
            calls.clear()
            out[f"k{k}/logits"] = float((logits - want_logits).abs().max())
            out[f"k{k}/grads"] = max(float((grads[n] - g).abs().max() / (g.abs().max() + 1e-12))
                                     for n, g in want_grads.items())
        return out
    finally:
        pm.destroy_parallel()


@pytest.mark.parametrize("sequence_parallel,tokens", [(False, 13), (True, 14)])
def test_chunked_row_parallel_equals_plain(sequence_parallel, tokens):
    results = run_distributed(_tp2_chunked_vs_plain, 2, sequence_parallel, tokens, timeout=120)
    for rank, res in enumerate(results):
        for k in (2, 3):
            assert res[f"k{k}/chunked_calls"] == 2 * 2, f"rank {rank} k={k}: chunked path not taken"
            assert res[f"k{k}/logits"] <= TOL, f"rank {rank} k={k} logits {res[f'k{k}/logits']:.2e}"
            assert res[f"k{k}/grads"] <= TOL, f"rank {rank} k={k} grads rel {res[f'k{k}/grads']:.2e}"


def test_env_switch_rejects_bad_values(monkeypatch):
    from parallel_models.errors import ConfigError
    from parallel_models.llama.layers import row_overlap
    from parallel_models.options import options_override

    monkeypatch.setenv("PARALLEL_MODELS_TP_OVERLAP_CHUNKS", "two")
    with pytest.raises(ConfigError, match="PARALLEL_MODELS_TP_OVERLAP_CHUNKS='two'"):
        row_overlap.configured_overlap_chunks()
    monkeypatch.setenv("PARALLEL_MODELS_TP_OVERLAP_CHUNKS", "4")
    assert row_overlap.configured_overlap_chunks() == 4
    monkeypatch.delenv("PARALLEL_MODELS_TP_OVERLAP_CHUNKS")
    assert row_overlap.configured_overlap_chunks() == 0
    with options_override(tp_overlap_chunks=3):
        assert row_overlap.configured_overlap_chunks() == 3
    with pytest.raises(ConfigError, match="tp_overlap_chunks"):
        with options_override(tp_overlap_chunks=-1):
            pass
