"""The producer of an async run: :class:`StepPlan` knows each step's prompts as the trainer's
loader will hand them out (a loader of its own, started from the trainer's state: the data
cursor stays the trainer's, so a resumed run regenerates what was in flight and trains no sample
twice); :class:`Producer` asks the rollout server for step after step, starting step ``s``
once the server holds trainer version ``s - k`` (``rollout.max_staleness``), on a thread of its
own while earlier steps may still be generating (the server batches them together), and hands
the steps to the trainer in order: no sample it makes is more than ``k`` versions behind when
trained.
"""

from __future__ import annotations

import dataclasses
import threading
import time


@dataclasses.dataclass
class PlannedStep:
    """One step's prompts of this rank (its data-parallel share) and their draw seeds."""

    step: int
    prompt_ids: list
    prompt_seeds: list | None
    prompt_caps: list | None = None  # data.max_new_tokens_key: each prompt's response cap

    def key(self, sampling) -> tuple:
        return request_key(self.prompt_ids, sampling, self.prompt_seeds, self.prompt_caps)


def request_key(prompt_ids, sampling, prompt_seeds, prompt_caps=None) -> tuple:
    """What identifies a generate call: its prompts, draw seeds, response caps and sampling."""
    return (tuple(tuple(int(t) for t in p) for p in prompt_ids), sampling.n,
            sampling.sampling_key(),
            None if prompt_seeds is None else tuple(int(s) for s in prompt_seeds),
            None if prompt_caps is None else tuple(int(c) for c in prompt_caps))


class StepPlan:
    """Step after step, this rank's prompts (``PPOTrainer._draw_rollout``'s choice: the
    ``dp_rank``-th of every ``dp_size`` prompts; seeds ``prompt_seed(seed, step, index)``,
    None when greedy; ``caps(records, rows)``: their response caps, as the trainer reads them)."""

    def __init__(self, loader, first_step: int, *, dp_rank: int, dp_size: int, seed: int,
                 greedy: bool, caps=None):
        from parallel_models.rl.data.prompts import PromptLoader

        self.loader = PromptLoader(loader.dataset, batch_size=loader.batch_size,
                                   shuffle=loader.shuffle, seed=loader.seed)
        self.loader.load_state_dict(loader.state_dict())
        self.step = first_step
        self.dp_rank, self.dp_size, self.seed, self.greedy = dp_rank, dp_size, seed, greedy
        self.caps = caps  # records, rows -> the rows' response caps (None: no per-prompt caps)
        self.last: PlannedStep | None = None

    def next(self) -> PlannedStep:
        from parallel_models.inference import prompt_seed

        records = self.loader.next_batch()
        prompt_ids = records["input_ids"]
        mine = [i for i in range(len(prompt_ids)) if i % self.dp_size == self.dp_rank]
        seeds = None if self.greedy else [prompt_seed(self.seed, self.step, i) for i in mine]
        caps = None if self.caps is None else self.caps(records, mine)
        self.last = PlannedStep(self.step, [prompt_ids[i] for i in mine], seeds, caps)
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
    """The threads filling the queue: ``request(planned) -> (rollout dict, token versions)``
    for step after step of ``plan`` until ``last_step`` (exclusive). A dispatcher starts each
    step's request on a thread of its own as soon as the server holds trainer version
    ``step - max_staleness``, whether or not the earlier steps' requests have returned (the
    server batches them continuously: the next step's rows fill the current one's tail); the
    trainer takes the steps in order (:meth:`take`). At most ``max_staleness + 1`` steps are
    requested and not yet taken (the version rule allows no more)."""

    def __init__(self, plan: StepPlan, versions, request, max_staleness: int, last_step: int):
        self.plan, self.versions, self.request = plan, versions, request
        self.max_staleness, self.last_step = max_staleness, last_step
        self.stopping = threading.Event()
        self._changed = threading.Condition()
        self._done: dict[int, Produced] = {}  # finished requests, by step, not yet taken
        self._open = 0            # steps requested and not yet taken
        self._in_flight = 0       # requests sent, not yet answered
        self._idle, self._idle_since = 0.0, time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="async-rollout-producer",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def take_idle(self) -> float:
        """Seconds with no request of this producer at the server since the last call."""
        now = time.perf_counter()
        with self._changed:
            idle, self._idle = self._idle, 0.0
            if self._in_flight == 0:
                idle += now - self._idle_since
                self._idle_since = now
        return idle

    def ready(self) -> int:
        """Steps whose samples are ready and not yet taken."""
        with self._changed:
            return len(self._done)

    def _run(self) -> None:
        while not self.stopping.is_set() and self.plan.step < self.last_step:
            planned = self.plan.next()
            self.versions.wait_for(planned.step - self.max_staleness, self.stopping)
            with self._changed:  # (the version rule already bounds it; kept explicit)
                while self._open > self.max_staleness and not self.stopping.is_set():
                    self._changed.wait(0.2)
                if self.stopping.is_set():
                    break
                self._open += 1
                if self._in_flight == 0:
                    self._idle += time.perf_counter() - self._idle_since
                self._in_flight += 1
            threading.Thread(target=self._fetch, args=(planned,), daemon=True,
                             name=f"async-rollout-step-{planned.step}").start()
            with self._changed:
                if any(item.error is not None for item in self._done.values()):
                    break

    def _fetch(self, planned: PlannedStep) -> None:
        try:
            batch, token_versions = self.request(planned)
            item = Produced(planned.step, batch, token_versions)
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer
            item = Produced(planned.step, error=exc)
        with self._changed:
            self._done[planned.step] = item
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle_since = time.perf_counter()
            self._changed.notify_all()

    def take(self, step: int, check=None) -> Produced:
        """The samples of ``step`` (waits for them); the producer's error re-raised;
        ``check()`` (raises to stop waiting) is called about every second meanwhile."""
        with self._changed:
            while step not in self._done:
                if check is not None:
                    check()
                if not self._thread.is_alive() and self._in_flight == 0:
                    failed = [item for item in self._done.values() if item.error is not None]
                    if not failed:
                        raise RuntimeError(f"the async rollout producer stopped before step "
                                           f"{step}")
                    item = failed[0]
                    break
                self._changed.wait(1.0)
            else:
                item = self._done.pop(step)
                self._open -= 1
                self._changed.notify_all()
            earlier = [s for s in self._done if s < step]
        if item.error is not None:
            raise RuntimeError(f"async rollout of step {item.step} failed: "
                               f"{type(item.error).__name__}: {item.error}") from item.error
        if earlier:
            raise RuntimeError(f"async rollout: step {min(earlier)} is ready, the trainer is "
                               f"at step {step}")
        return item

    def stop(self) -> None:
        self.stopping.set()
        self.versions.wake()
        with self._changed:
            self._changed.notify_all()
        self._thread.join(timeout=60)


__all__ = ["PlannedStep", "Produced", "Producer", "StepPlan", "request_key"]
