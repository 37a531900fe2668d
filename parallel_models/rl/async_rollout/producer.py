"""The producer of an async run: :class:`StepPlan` knows each step's prompts as the trainer's
loader will hand them out (a loader of its own, started from the trainer's state: the data
cursor stays the trainer's, so a resumed run regenerates what was in flight and trains no sample
twice); :class:`Producer` is the thread that asks the rollout server for step after step into a
bounded queue, starting step ``s`` only once the server holds trainer version ``s - k``
(``rollout.max_staleness``): no sample it makes is more than ``k`` versions behind when trained.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time


@dataclasses.dataclass
class PlannedStep:
    """One step's prompts of this rank (its data-parallel share) and their draw seeds."""

    step: int
    prompt_ids: list
    prompt_seeds: list | None

    def key(self, sampling) -> tuple:
        return request_key(self.prompt_ids, sampling, self.prompt_seeds)


def request_key(prompt_ids, sampling, prompt_seeds) -> tuple:
    """What identifies a generate call: its prompts, draw seeds and sampling."""
    return (tuple(tuple(int(t) for t in p) for p in prompt_ids), sampling.n,
            sampling.sampling_key(),
            None if prompt_seeds is None else tuple(int(s) for s in prompt_seeds))


class StepPlan:
    """Step after step, this rank's prompts (``PPOTrainer._draw_rollout``'s choice: the
    ``dp_rank``-th of every ``dp_size`` prompts; seeds ``prompt_seed(seed, step, index)``,
    None when greedy)."""

    def __init__(self, loader, first_step: int, *, dp_rank: int, dp_size: int, seed: int,
                 greedy: bool):
        from parallel_models.rl.data.prompts import PromptLoader

        self.loader = PromptLoader(loader.dataset, batch_size=loader.batch_size,
                                   shuffle=loader.shuffle, seed=loader.seed)
        self.loader.load_state_dict(loader.state_dict())
        self.step = first_step
        self.dp_rank, self.dp_size, self.seed, self.greedy = dp_rank, dp_size, seed, greedy
        self.last: PlannedStep | None = None

    def next(self) -> PlannedStep:
        from parallel_models.inference import prompt_seed

        records = self.loader.next_batch()
        prompt_ids = records["input_ids"]
        mine = [i for i in range(len(prompt_ids)) if i % self.dp_size == self.dp_rank]
        seeds = None if self.greedy else [prompt_seed(self.seed, self.step, i) for i in mine]
        self.last = PlannedStep(self.step, [prompt_ids[i] for i in mine], seeds)
        self.step += 1
        return self.last

    def at(self, step: int) -> PlannedStep | None:
        """The plan of ``step`` (steps asked in order; None for one already passed)."""
        while self.last is None or self.last.step < step:
            self.next()
        return self.last if self.last.step == step else None


@dataclasses.dataclass
class Produced:
    """A step's samples from the server: the rollout dict (``samples_batch``), each sample's
    tokens' server weight versions, or the error that stopped the request."""

    step: int
    batch: dict | None = None
    token_versions: list | None = None
    error: BaseException | None = None


class Producer:
    """The thread filling the queue: ``request(planned) -> (rollout dict, token versions)``
    runs step after step from ``plan`` until ``last_step`` (exclusive)."""

    def __init__(self, plan: StepPlan, versions, request, max_staleness: int, last_step: int):
        self.plan, self.versions, self.request = plan, versions, request
        self.max_staleness, self.last_step = max_staleness, last_step
        self.queue: queue.Queue = queue.Queue(maxsize=max_staleness + 1)
        self.stopping = threading.Event()
        self._idle, self._lock = 0.0, threading.Lock()
        self._thread = threading.Thread(target=self._run, name="async-rollout-producer",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _add_idle(self, seconds: float) -> None:
        with self._lock:
            self._idle += seconds

    def take_idle(self) -> float:
        """Seconds the producer waited (for weights or a queue slot) since the last call."""
        with self._lock:
            idle, self._idle = self._idle, 0.0
        return idle

    def _run(self) -> None:
        while not self.stopping.is_set() and self.plan.step < self.last_step:
            planned = self.plan.next()
            t0 = time.perf_counter()
            self.versions.wait_for(planned.step - self.max_staleness, self.stopping)
            self._add_idle(time.perf_counter() - t0)
            if self.stopping.is_set():
                break
            try:
                batch, token_versions = self.request(planned)
                item = Produced(planned.step, batch, token_versions)
            except BaseException as exc:  # noqa: BLE001 - handed to the trainer
                item = Produced(planned.step, error=exc)
            t0 = time.perf_counter()
            while not self.stopping.is_set():
                try:
                    self.queue.put(item, timeout=0.2)
                    break
                except queue.Full:
                    continue
            self._add_idle(time.perf_counter() - t0)
            if item.error is not None:
                break

    def take(self, step: int) -> Produced:
        """The samples of ``step`` (waits for them); the producer's error re-raised."""
        while True:
            try:
                item = self.queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self.queue.empty():
                    raise RuntimeError(f"the async rollout producer stopped before step {step}")
        if item.error is not None:
            raise RuntimeError(f"async rollout of step {item.step} failed: "
                               f"{type(item.error).__name__}: {item.error}") from item.error
        if item.step != step:
            raise RuntimeError(f"async rollout: the queue holds step {item.step}, the trainer "
                               f"is at step {step}")
        return item

    def stop(self) -> None:
        self.stopping.set()
        self.versions.wake()
        self._thread.join(timeout=60)


__all__ = ["PlannedStep", "Produced", "Producer", "StepPlan", "request_key"]
