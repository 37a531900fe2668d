"""utils/offload.Offloader: parameters, buffers, plain grads, megatron DDP grad buffers and
optimizer states leave the compute device and come back bit-identical, with the bytes moved
counted; on a CPU-only machine the host copy is a fresh storage (same bookkeeping), on CUDA the
tensors really move (pinned host buffers, reused)."""

import pytest
import torch

from parallel_models.testing import run_distributed
from parallel_models.utils.offload import Offloader


def _nbytes(ts):
    return sum(t.numel() * t.element_size() for t in ts)


def _tiny(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8),
                                torch.nn.Linear(8, 2))
    model.register_buffer("scale", torch.arange(3.0))
    return model


def _train(model, opt, steps=1):
    for _ in range(steps):
        opt.zero_grad()
        model(torch.ones(5, 4, device=model[0].weight.device)).square().sum().backward()
        opt.step()


def test_round_trip_bytes_and_fresh_storage_on_cpu():
    model = _tiny()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _train(model, opt)
    off = Offloader(model, opt, device="cpu")
    params, grads = list(model.parameters()), [p.grad for p in model.parameters()]
    states = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    before = [t.clone() for t in params + grads + states + [model.scale]]
    ptrs = [t.data_ptr() for t in params + states + [model.scale]]
    want = _nbytes(params) + _nbytes(grads) + _nbytes(states) + _nbytes([model.scale])

    assert off.offload() == want and off.is_offloaded
    assert off.offload() == 0  # idempotent
    assert list(model.parameters()) == params  # same Parameter objects (optimizer refs hold)
    now_states = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    now = [p.data for p in params] + now_states + [model.scale]
    assert not any(t.data_ptr() == p for t, p in zip(now, ptrs)), "a tensor kept its storage"

    assert off.onload() == want and not off.is_offloaded
    after = [p.data for p in params] + [p.grad for p in params] + [
        v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)] + [model.scale]
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    # training continues exactly as without the round trip
    twin = _tiny()
    twin_opt = torch.optim.Adam(twin.parameters(), lr=0.1)
    _train(twin, twin_opt)
    _train(model, opt, 2)
    _train(twin, twin_opt, 2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_groups_and_on_device_context():
    model = _tiny()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _train(model, opt)
    off = Offloader([model], opt, device="cpu")
    assert off.offload(with_optimizer=False) > 0
    assert off.offloaded == {"model": True, "optimizer": False}
    off.offload()
    with off.on_device() as o:  # the model only, for a forward pass
        assert o.offloaded == {"model": False, "optimizer": True}
    assert off.offloaded == {"model": True, "optimizer": True}  # put back what it brought
    with off.on_device(with_optimizer=True):
        _train(model, opt)
    assert off.offloaded == {"model": True, "optimizer": True}
    off.onload()
    with off.on_device(offload_after=True):
        pass
    assert off.is_offloaded
    with off.on_device(offload_after=False):
        pass
    assert not off.is_offloaded and off.onload(with_optimizer=False) == 0
    assert off.offloaded["optimizer"] and off.onload() > 0


def test_tensors_off_the_compute_device_stay():
    """Only tensors on the compute device move (a CPU-built buffer of a CUDA model stays)."""
    model = _tiny()
    off = Offloader(model, device="meta")  # nothing here lives on 'meta'
    assert off.offload() == 0 and off.onload() == 0
    assert all(p.device.type == "cpu" for p in model.parameters())


def _ddp_worker(path: str, distributed: bool = False, dtype=torch.float32) -> dict:
    """A megatron-core DDP model + optimizer (TP=1, one rank; ``distributed``: megatron's
    distributed optimizer, whose parameters are views into DDP's parameter buffer): offload
    between two train steps must not change the second step."""
    import parallel_models as pm
    from parallel_models.pipeline import train_step
    from parallel_models.utils.optimizer import OptimConfig, build_optimizer

    pm.init_parallel(tensor_parallel_size=1)
    cls = pm.get_model_class(pm.registry.architecture_of(path), "causal_lm", rmpad=True)
    ids = torch.randint(1, 100, (12,), generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    mb = {"input_ids": ids, "cu_seqlens": cu, "max_seqlen": 7,
          "position_ids": torch.cat([torch.arange(5), torch.arange(7)])}

    def loss_fn(out, mb):
        loss = out.logits.float().logsumexp(-1).sum()
        return loss, torch.tensor(12), {"loss": loss.detach()}

    results = []
    for use_offload in (False, True):
        torch.manual_seed(0)
        model = cls.from_pretrained(path, dtype=dtype)
        state = build_optimizer([model], OptimConfig(lr=1e-2, clip_grad=1.0,
                                                     use_distributed_optimizer=distributed))
        train_step(state, [dict(mb)], loss_fn)
        off = Offloader(state.chunks, state.optimizer)  # the compute device (CUDA or CPU)
        info = {}
        if use_offload and distributed:
            bufs = off.param_buffers() + off.grad_buffers()
            info["n_param_buffers"] = len(off.param_buffers())
            info["want"] = sum(g.untyped_storage().nbytes() for g in bufs) + _nbytes(
                [s.get() for s in off.optimizer_slots()]
                + [b for m in model.modules() for b in m._buffers.values() if b is not None])
            info["moved"] = off.offload()
            info["storage_after_offload"] = sum(g.untyped_storage().nbytes() for g in bufs)
            info["back"] = off.onload()
        elif use_offload:
            grad_bufs = off.grad_buffers()
            params = list(model.parameters())
            states = [t for t in (s.get() for s in off.optimizer_slots())]
            info["n_grad_buffers"] = len(grad_bufs)
            device = off.device.type  # what lives elsewhere (a CPU-built buffer) stays
            info["want"] = _nbytes([t for t in params + states + [
                b for m in model.modules() for b in m._buffers.values() if b is not None]
                if t.device.type == device]) + sum(g.untyped_storage().nbytes() for g in grad_bufs)
            info["moved"] = off.offload()
            info["grad_storage_after_offload"] = sum(g.untyped_storage().nbytes()
                                                     for g in grad_bufs)
            info["back"] = off.onload()
        out = train_step(state, [dict(mb)], loss_fn)
        info["grad_norm"] = out["grad_norm"]
        info["weights"] = {k: v.clone() for k, v in model.state_dict().items()
                           if torch.is_tensor(v)}
        results.append(info)
    return results


def test_megatron_ddp_grad_buffers_and_optimizer(hf_models):
    plain, offl = run_distributed(_ddp_worker, 1, hf_models[("llama", "causal_lm")])[0]
    assert offl["n_grad_buffers"] >= 1
    assert offl["moved"] == offl["want"] == offl["back"] and offl["moved"] > 0
    assert offl["grad_storage_after_offload"] == 0  # released, not copied
    assert offl["grad_norm"] == plain["grad_norm"]
    for k, v in plain["weights"].items():
        assert torch.equal(v, offl["weights"][k]), k


def test_distributed_optimizer_buffers_round_trip(hf_models):
    """megatron's distributed optimizer (bf16 weights: fp32 main shards and Adam states in the
    optimizer): the parameter and gradient buffers are released on offload and come back
    bit-exactly, so the next step equals the step without offload."""
    plain, offl = run_distributed(_ddp_worker, 1, hf_models[("llama", "causal_lm")], True,
                                  torch.bfloat16)[0]
    assert offl["n_param_buffers"] >= 1
    assert offl["moved"] == offl["want"] == offl["back"] and offl["moved"] > 0
    assert offl["storage_after_offload"] == 0
    assert offl["grad_norm"] == plain["grad_norm"]
    for k, v in plain["weights"].items():
        assert torch.equal(v, offl["weights"][k]), k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_moves_to_pinned_host_and_back():
    model = _tiny().cuda()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _train(model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    off = Offloader(model, opt, device=torch.device("cuda", torch.cuda.current_device()))
    base = torch.cuda.memory_allocated()
    moved = off.offload()
    assert moved > 0 and torch.cuda.memory_allocated() <= base - moved
    assert all(not p.is_cuda and p.is_pinned() for p in model.parameters())
    hosts = [p.data.data_ptr() for p in model.parameters()]
    assert off.onload() == moved and all(p.is_cuda for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    off.offload()  # the pinned host buffers are reused
    assert [p.data.data_ptr() for p in model.parameters()] == hosts
