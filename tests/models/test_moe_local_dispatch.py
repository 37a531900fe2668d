"""MoE dispatch on the device (``layers/moe_local_dispatch``) against megatron-core's all-to-all
dispatcher: the same output bit for bit, for the three MoE families (Qwen3-MoE, Qwen2-MoE with
its gated shared expert, Mixtral), fp32 and bf16, grouped GEMMs on and off, with no op that
reads the device from the host (what kept an MoE decode step out of CUDA graphs)."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from torch.utils._python_dispatch import TorchDispatchMode

# ops whose output size or value the host must read: not capturable in a CUDA graph
HOST_READS = ("_local_scalar_dense", "nonzero", "masked_select", "_unique", "repeat_interleave")


class _HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(name in str(func) for name in HOST_READS):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import parallel_models as pm
    from parallel_models.testing import save_tiny_hf_model

    pm.init_parallel()
    root = tmp_path_factory.mktemp("moe_dispatch")
    return {f: save_tiny_hf_model(str(root / f), f, seed=1)
            for f in ("qwen3_moe", "qwen2_moe", "mixtral")}


@pytest.mark.parametrize("grouped", ["0", "1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_device_dispatch_equals_megatron_dispatcher(models, family, dtype, grouped, monkeypatch):
    import parallel_models as pm
    from parallel_models.llama.layers import moe_local_dispatch
    from parallel_models.llama.layers.moe import ParallelMoE

    monkeypatch.setenv("PARALLEL_MODELS_MOE_GROUPED_GEMM", grouped)
    model = pm.AutoModelForCausalLM.from_pretrained(models[family], rmpad=True, dtype=dtype)
    layers = [m for m in model.modules() if isinstance(m, ParallelMoE)]
    assert layers
    g = torch.Generator().manual_seed(0)
    for moe in layers:
        for tokens in (1, 7, 33):  # a decode row, a few, more tokens than experts x top-k
            hidden = torch.randn(tokens, 1, moe.config.hidden_size, generator=g).to(dtype)
            with torch.no_grad():
                assert moe_local_dispatch.applies(moe, hidden)
                with _HostReads() as probe:
                    ours = moe(hidden)
                ref, bias = MoELayer.forward(moe, hidden)  # megatron-core's dispatcher
            assert bias is None
            assert torch.equal(ours, ref), (family, dtype, tokens,
                                            (ours.float() - ref.float()).abs().max())
            if grouped == "1":  # the SequentialMLP fallback splits by counts on the host
                assert probe.seen == [], probe.seen


def test_autograd_forward_keeps_megatron_dispatcher(models):
    import parallel_models as pm
    from parallel_models.llama.layers import moe_local_dispatch
    from parallel_models.llama.layers.moe import ParallelMoE

    model = pm.AutoModelForCausalLM.from_pretrained(models["qwen3_moe"], rmpad=True,
                                                   dtype=torch.float32)
    moe = next(m for m in model.modules() if isinstance(m, ParallelMoE))
    hidden = torch.randn(5, 1, moe.config.hidden_size, requires_grad=True)
    assert not moe_local_dispatch.applies(moe, hidden)
    moe(hidden).sum().backward()
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()
