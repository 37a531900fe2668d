"""A TP > 1 rollout server forwards pushed weights from rank 0 as raw tensor broadcasts
(server/weight_broadcast.py): the other ranks get the same tensors bit for bit, and the command
that goes through ``broadcast_object_list`` carries only the buckets' headers, not the model."""

import pickle

import torch

from parallel_models.testing import run_distributed


def _staged():
    from parallel_models.inference.server.weight_stream import (StreamParser, bucket_frame,
                                                                 end_frame)

    g = torch.Generator().manual_seed(0)
    buckets = [{"a.weight": torch.randn(64, 32, generator=g),
                "b.weight": torch.randn(5, generator=g)},
               {"c.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16)}]
    parser = StreamParser()
    for bucket in buckets:
        for part in bucket_frame(bucket):
            parser.feed(part)
    parser.feed(end_frame(3))
    parser.finish()
    return parser


def forward_pushed(starve_rank: int | None = None) -> dict:
    import torch.distributed as dist

    from parallel_models.inference.server.weight_broadcast import receive_pushed, send_pushed
    from parallel_models.inference.server.weight_stream import PushedWeights

    dist.init_process_group("gloo")  # run_distributed set the rendezvous variables
    group = dist.new_group(backend="gloo")
    parser = _staged()
    want = PushedWeights(parser.tensors, parser.frames)
    box = [("update_pushed", want.headers()) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    headers = box[0][1]
    if dist.get_rank() == starve_rank:  # a buffer it cannot allocate: out of host memory
        headers = [(entries, 1 << 62) for entries, _ in headers]
    if dist.get_rank() == 0:
        if not send_pushed(want, group):
            return {"sent": False}
        got = want
    else:
        got = receive_pushed(headers, group)
        if not got.frames:
            return {"sent": False, "reason": got.reason}
    model_bytes = sum(len(p) for _, p in want.frames)
    return {"equal": list(got.keys()) == list(want.keys()) and all(
                torch.equal(got.tensors[n], want.tensors[n]) and
                got.tensors[n].dtype == want.tensors[n].dtype for n in want.keys()),
            "command_bytes": len(pickle.dumps(box[0])), "model_bytes": model_bytes}


def test_pushed_weights_reach_every_rank_without_pickling_the_model():
    out = run_distributed(forward_pushed, 2, timeout=120)
    assert all(o["equal"] for o in out), out
    # the command is the headers only: a few hundred bytes, not the ~9 KB of tensors
    assert all(o["command_bytes"] < 1024 < o["model_bytes"] for o in out), out


def test_a_rank_without_room_stops_the_forward_on_every_rank():
    """One receiver cannot allocate its buffers: no rank blocks in a broadcast, rank 0 sends
    nothing, and the others hand the engine a reader that fails (its vote keeps the old weights)."""
    out = run_distributed(forward_pushed, 3, 2, timeout=120)
    assert [o["sent"] for o in out] == [False] * 3, out
    assert "out of host memory" in out[2]["reason"] and "another rank" in out[1]["reason"], out
