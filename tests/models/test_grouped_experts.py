"""Grouped-GEMM experts (``layers/grouped_experts``): forwards without autograd read the expert
weights in place, packed once into one tensor per projection that the parameters are views of;
the values equal the stacking path and megatron-core's ``SequentialMLP`` loop, gradients still
reach every expert, and weights re-pointed elsewhere (an offload round trip, a DDP buffer) are
packed again or left alone."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.moe.experts import SequentialMLP


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    import parallel_models as pm
    from parallel_models.testing import save_tiny_hf_model

    pm.init_parallel()
    path = save_tiny_hf_model(str(tmp_path_factory.mktemp("grouped") / "m"), "qwen3_moe", seed=2)
    return path


def _experts(path):
    import parallel_models as pm
    from parallel_models.llama.layers.grouped_experts import GroupedGemmExperts

    model = pm.AutoModelForCausalLM.from_pretrained(path, rmpad=True, dtype=torch.float32)
    return [m for m in model.modules() if isinstance(m, GroupedGemmExperts)]


def _inputs(experts, tokens=13, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, experts.config.hidden_size, generator=g)
    counts = torch.zeros(experts.num_local_experts, dtype=torch.long)
    for i in torch.randint(0, experts.num_local_experts, (tokens,), generator=g):
        counts[i] += 1
    return x, counts, torch.rand(tokens, generator=g)


def _is_packed(experts, attr):
    from parallel_models.llama.layers.grouped_experts import packed_view

    return packed_view([getattr(e, attr).weight for e in experts.local_experts]) is not None


def test_no_grad_forward_packs_and_equals_the_loop(moe_model, monkeypatch):
    monkeypatch.setenv("PARALLEL_MODELS_MOE_GROUPED_GEMM", "1")
    experts = _experts(moe_model)[0]
    x, counts, probs = _inputs(experts)
    assert not _is_packed(experts, "linear_fc1")
    with torch.no_grad():
        loop, _ = SequentialMLP.forward(experts, x, counts, probs)  # megatron-core's loop
        first, _ = experts(x, counts, probs)  # packs on the way
    assert _is_packed(experts, "linear_fc1") and _is_packed(experts, "linear_fc2")
    with torch.no_grad():
        packed, _ = experts(x, counts, probs)
    torch.testing.assert_close(first, loop, rtol=1e-5, atol=1e-6)
    assert torch.equal(packed, first)
    # the stack of the autograd path reads the same packed weights: same values, and every
    # expert that got tokens gets its gradient
    with_grad, _ = experts(x, counts, probs)
    assert torch.equal(with_grad.detach(), packed)
    with_grad.square().sum().backward()
    for e, n in zip(experts.local_experts, counts.tolist()):
        grad = e.linear_fc1.weight.grad
        assert (grad is not None and grad.abs().sum() > 0) == (n > 0)


def test_repointed_weights_are_packed_again_or_left_alone(moe_model, monkeypatch):
    monkeypatch.setenv("PARALLEL_MODELS_MOE_GROUPED_GEMM", "1")
    experts = _experts(moe_model)[0]
    x, counts, probs = _inputs(experts, seed=1)
    with torch.no_grad():
        before, _ = experts(x, counts, probs)
    # an offload round trip gives every parameter its own storage again: packed again
    for e in experts.local_experts:
        e.linear_fc1.weight.data = e.linear_fc1.weight.data.clone()
    assert not _is_packed(experts, "linear_fc1")
    with torch.no_grad():
        again, _ = experts(x, counts, probs)
    assert _is_packed(experts, "linear_fc1") and torch.equal(again, before)
    # views into a buffer someone else owns (megatron DDP's parameter buffer), in reverse
    # order: never re-pointed, stacked instead
    ws = [e.linear_fc2.weight for e in experts.local_experts]
    buffer = torch.cat([w.detach().reshape(-1) for w in reversed(ws)])
    n = ws[0].numel()
    for i, w in enumerate(reversed(ws)):
        w.data = buffer[i * n:(i + 1) * n].view_as(w)
    with torch.no_grad():
        owned, _ = experts(x, counts, probs)
    assert torch.equal(owned, before)
    assert all(w.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr() for w in ws)


def test_packed_model_saves_and_reloads(moe_model, tmp_path, monkeypatch):
    """Packed expert weights are views of one tensor: saving still writes each expert's own
    values (safetensors refuses shared storage; a view must not drag the whole pack along)."""
    import os
    import pathlib

    import parallel_models as pm
    from parallel_models.llama.layers.grouped_experts import GroupedGemmExperts

    monkeypatch.setenv("PARALLEL_MODELS_MOE_GROUPED_GEMM", "1")
    model = pm.AutoModelForCausalLM.from_pretrained(moe_model, rmpad=True, dtype=torch.float32)
    ids = torch.randint(0, 200, (12,), generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, 12], dtype=torch.int32)
    with torch.no_grad():
        ref = model(ids, cu).logits
    experts = next(m for m in model.modules() if isinstance(m, GroupedGemmExperts))
    assert _is_packed(experts, "linear_fc1")
    out = tmp_path / "saved"
    model.save_pretrained(str(out))

    def weights_bytes(folder):
        return sum(os.path.getsize(folder / f) for f in os.listdir(folder)
                   if f.endswith(".safetensors"))

    assert weights_bytes(out) <= weights_bytes(pathlib.Path(moe_model)) * 1.01
    again = pm.AutoModelForCausalLM.from_pretrained(str(out), rmpad=True, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(again(ids, cu).logits, ref)
