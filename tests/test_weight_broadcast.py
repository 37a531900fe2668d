"""A TP > 1 rollout server forwards pushed weights from rank 0 as raw tensor broadcasts
(server/weight_broadcast.py): the other ranks get the same tensors bit for bit, and the command
that goes through ``broadcast_object_list`` carries only the buckets' headers, not the model."""

import pickle

import torch

from parallel_models.testing import run_distributed


def _staged():
    from parallel_models.rl.rollout.server.weight_stream import (StreamParser, bucket_frame,
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


def forward_pushed() -> dict:
    import torch.distributed as dist

    from parallel_models.rl.rollout.server.weight_broadcast import receive_pushed, send_pushed
    from parallel_models.rl.rollout.server.weight_stream import PushedWeights

    dist.init_process_group("gloo")  # run_distributed set the rendezvous variables
    group = dist.new_group(backend="gloo")
    parser = _staged()
    want = PushedWeights(parser.tensors, parser.frames)
    box = [("update_pushed", want.headers()) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    if dist.get_rank() == 0:
        send_pushed(want, group)
        got = want
    else:
        got = receive_pushed(box[0][1], group)
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
