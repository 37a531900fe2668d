"""The async producer's concurrency (``rl/async_rollout/producer.py``): each step's request
starts as soon as the server holds trainer version ``step - k``, while earlier requests are
still generating, never earlier; the trainer gets the steps in order whatever order they finish
in; a failed request reaches the trainer as an error of its step."""

import threading

import pytest

from parallel_models.rl.async_rollout.producer import PlannedStep, Producer
from parallel_models.rl.async_rollout.versions import PolicyVersions

WAIT = 10.0  # seconds: a bound on waits that should end at once


class _Plan:
    """Steps 0, 1, ... with one prompt each (the trainer's loader is not needed here)."""

    def __init__(self):
        self.step = 0

    def next(self):
        self.step += 1
        return PlannedStep(self.step - 1, [[self.step - 1]], None)


class _Server:
    """A request per step that returns when the test releases it; records the starts."""

    def __init__(self, fail_step=None):
        self.started: list[int] = []
        self.release = {s: threading.Event() for s in range(8)}
        self.changed = threading.Condition()
        self.fail_step = fail_step

    def request(self, planned):
        with self.changed:
            self.started.append(planned.step)
            self.changed.notify_all()
        assert self.release[planned.step].wait(WAIT)
        if planned.step == self.fail_step:
            raise ConnectionError("server gone")
        return {"step": planned.step}, [[planned.step]]

    def wait_started(self, count):
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.started) >= count, WAIT), self.started


def _producer(server, k, last_step=4):
    versions = PolicyVersions()
    producer = Producer(_Plan(), versions, server.request, k, last_step)
    producer.start()
    return producer, versions


def test_requests_overlap_within_the_version_rule_and_arrive_in_order():
    server = _Server()
    producer, versions = _producer(server, k=1)
    try:
        versions.pushed(0, 10)
        server.wait_started(2)  # steps 0 and 1 both in flight under version 0
        assert server.started == [0, 1]
        server.release[1].set()  # step 1 finishes first: held until step 0 is taken
        with producer._changed:
            assert producer._changed.wait_for(lambda: producer.ready() == 1, WAIT)
        assert server.started == [0, 1]  # step 2 needs version 1
        server.release[0].set()
        assert producer.take(0).batch == {"step": 0}
        assert producer.ready() == 1
        versions.pushed(1, 11)
        server.wait_started(3)
        assert server.started == [0, 1, 2]
        assert producer.take(1).batch == {"step": 1}
        for s in (2, 3):
            server.release[s].set()
        versions.pushed(2, 12)
        assert producer.take(2).token_versions == [[2]]
        assert producer.take(3).step == 3
        assert server.started == [0, 1, 2, 3]
    finally:
        for event in server.release.values():
            event.set()
        producer.stop()


def test_k0_requests_one_step_at_a_time():
    server = _Server()
    producer, versions = _producer(server, k=0, last_step=2)
    try:
        versions.pushed(0, 10)
        server.release[0].set()
        assert producer.take(0).step == 0
        assert server.started == [0]  # step 1 waits for version 1
        versions.pushed(1, 11)
        server.release[1].set()
        assert producer.take(1).step == 1
    finally:
        for event in server.release.values():
            event.set()
        producer.stop()


def test_a_failed_request_is_the_error_of_its_step():
    server = _Server(fail_step=1)
    producer, versions = _producer(server, k=1)
    try:
        versions.pushed(0, 10)
        for s in (0, 1):
            server.release[s].set()
        assert producer.take(0).step == 0
        with pytest.raises(RuntimeError, match="step 1 failed: ConnectionError"):
            producer.take(1)
    finally:
        for event in server.release.values():
            event.set()
        producer.stop()
