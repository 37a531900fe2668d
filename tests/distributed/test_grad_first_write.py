"""megatron DDP buffers written by a step's first backward (``utils/grad_first_write.py``), on 2
gloo ranks (data parallel 2): over steps of several microbatches the reduced ``main_grad`` equals
megatron's own path (zeroed buffers + adds) bit for bit; a parameter that gets no gradient in a
step ends the step with a zero ``main_grad``, not last step's; the buffers' memset is skipped
(and kept when the weight-gradient GEMMs accumulate into the buffers themselves, or with the
option ``grad_first_write`` off). Training with it against transformers: every
``check_train_steps`` test (tests/distributed/test_pipeline.py and others) runs with it on, the default."""

import pytest

from parallel_models.testing import run_distributed


def _run() -> dict:
    import torch
    from megatron.core import ModelParallelConfig
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    import parallel_models as pm
    from parallel_models import cpu_shim
    from parallel_models.options import options_override
    from parallel_models.utils import grad_first_write

    pm.init_parallel(tensor_parallel_size=1)
    rank = torch.distributed.get_rank()

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a = torch.nn.Linear(6, 5)
            self.b = torch.nn.Linear(5, 3)

        def forward(self, x, use_b):
            h = torch.tanh(self.a(x))
            return self.b(h).square().sum() if use_b else h.sum()

    def build(first_write: bool):
        module = Two()
        cfg = ModelParallelConfig()
        cfg.calculate_per_token_loss = False  # read by DDP (a TransformerConfig field)
        with cpu_shim.cuda_to_cpu(), grad_first_write.building():
            ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False), module)
        with options_override(grad_first_write=first_write):
            switched = grad_first_write.enable(ddp)
        resets = []
        for buf in ddp.buffers:
            original = buf.reset
            buf.reset = lambda original=original: (resets.append(1), original())[1]
        return ddp, switched, resets

    gen = torch.Generator().manual_seed(10 + rank)
    data = [torch.randn(4, 6, generator=gen) for _ in range(5)]
    # step 1: 3 microbatches through both layers; step 2: 2 through `a` only (b gets no grad)
    plan = [[(data[0], True), (data[1], True), (data[2], True)], [(data[3], False), (data[4], False)]]
    out = {}
    for mode in ("plain", "fused"):
        for name, first_write in (("on", True), ("off", False)):
            ddp, switched, resets = build(first_write)
            if mode == "fused":  # the flag utils/wgrad_fusion sets on a fused linear (a plain
                # nn.Linear ignores it; the buffers must still be zeroed)
                ddp.module.a.gradient_accumulation_fusion = True
            grads = []
            for step in plan:
                ddp.zero_grad_buffer()
                for x, use_b in step:
                    with cpu_shim.cuda_to_cpu():
                        ddp(x, use_b).backward()
                with cpu_shim.cuda_to_cpu():
                    ddp.finish_grad_sync()
                grads.append({n: p.main_grad.clone() for n, p in ddp.module.named_parameters()})
            out[mode, name] = {"switched": switched, "resets": len(resets), "grads": grads}
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_run, 2, timeout=300)


def test_first_write_equals_megatron_bitwise(results):
    for r in results:
        assert r["plain", "on"]["switched"] and not r["plain", "off"]["switched"]
        for on, off in zip(r["plain", "on"]["grads"], r["plain", "off"]["grads"]):
            assert on.keys() == off.keys()
            for name in on:
                assert on[name].equal(off[name]), name
    # data parallel: the reduced gradient is the same on both ranks
    for name, g in results[0]["plain", "on"]["grads"][0].items():
        assert g.equal(results[1]["plain", "on"]["grads"][0][name])


def test_parameter_without_gradient_ends_zero(results):
    for r in results:
        step1, step2 = r["plain", "on"]["grads"]
        assert step1["b.weight"].abs().sum() > 0
        assert step2["b.weight"].abs().sum() == 0 and step2["b.bias"].abs().sum() == 0
        assert step2["a.weight"].abs().sum() > 0


def test_memset_skipped_only_when_on(results):
    for r in results:
        assert r["plain", "on"]["resets"] == 0  # the buffers were never zeroed
        assert r["plain", "off"]["resets"] == 2  # one buffer, zeroed at each of the 2 steps


def test_memset_kept_when_gemms_accumulate_in_place(results):
    for r in results:
        assert r["fused", "on"]["switched"] and r["fused", "on"]["resets"] == 2
        for on, off in zip(r["fused", "on"]["grads"], r["fused", "off"]["grads"]):
            for name in on:
                assert on[name].equal(off[name]), name


_KERNEL = """
import torch
from parallel_models.utils import grad_buffer_kernels as K
gen = torch.Generator().manual_seed(0)
for dtype in (torch.bfloat16, torch.float16):
    for n in (1, 8191, 8192 * 2 + 5):
        grad = (torch.randn(n, generator=gen) * 3).to(dtype)
        start = torch.randn(n, generator=gen)
        for add in (False, True):
            main = start.clone()
            K.accumulate(main, grad, add)
            want = start + grad.float() if add else grad.float()
            assert torch.equal(main, want), (dtype, n, add)
print("kernel ok")
"""


def test_buffer_kernel_writes_and_adds_bitwise():
    """The CUDA path's Triton kernel (``utils/grad_buffer_kernels.py``) in the interpreter:
    write and add equal PyTorch's ``copy_`` / ``add_`` bit for bit (bf16 and fp16 gradients,
    sizes around the block)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", _KERNEL], env=env, capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0 and "kernel ok" in run.stdout, run.stderr[-3000:]
