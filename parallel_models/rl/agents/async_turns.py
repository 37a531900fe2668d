"""The asynchronous driver of a multi-turn rollout: each conversation goes on at its own pace on
the continuous engine; rows waiting on tools hold no decode slot (their KV is kept for re-entry).

Every model turn is one request of the
:class:`~parallel_models.inference.continuous.ContinuousEngine` (``n=1``, the prompt the whole
conversation so far, the turn's cap and draw seed). When a request finishes (a stop token, the
end of a tool call, its cap) its row leaves the decode batch at once, freeing its slot and KV
region; the turn is recorded and its tool calls start in the executor's thread pool. The engine
keeps stepping the other rows meanwhile; each step, the conversations whose tools finished run
their environment step, append the tool / observation messages and re-enter as new requests
(their prompt: the whole conversation). When no row is decoding, the driver waits for the first
tool to finish.

Re-entry costs only the new tokens: every turn is submitted with ``keep_kv`` and the next one
with ``resume`` (``ContinuousEngine``): a row leaving for a tool gives its decode slot back but
keeps its KV region, and on re-entry only its last generated id and the appended tool /
observation ids run through the model; the engine evicts kept regions when it runs out of KV
(that conversation then prefills all of it again). A re-entry with few new tokens (at most the
engine's ``decode_extension_tokens``) re-enters at once: the next decode step runs its tokens
beside the other rows (``inference/decode_layout.py``), no prefill call. Longer ones (and
evicted ones) are prefilled (``inference/kv_extend.py``) and gathered: such a conversation waits
until ``reentry_wait_steps`` decode steps have passed since the first one that became ready (or
until nothing decodes), and all of them are submitted together, so they share one prefill call
instead of each breaking into the decode steps with a prefill of its own. Kept regions are given
back when a conversation ends.

Same tokens as the turn-synchronous driver: a turn's draws use the seed
``row_seed(conversation seed, turn)`` in both, so its tokens do not depend on what else runs
(greedy or seeded); log-probs agree to float rounding (other batch compositions).

TP: every rank of a TP group must submit the same requests between the same steps. The tools run
on TP rank 0 only; whenever conversations wait on tools, rank 0 says after each step which of
them finished, with their results (``broadcast_object_list`` in the TP group), so every rank
re-enters the same conversations with the same tool results. Environments run on every rank
(they must be deterministic, as in the turn-synchronous driver).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import time

import torch.distributed as dist

from parallel_models.inference import row_seed
from parallel_models.rl.agents.conversation import Conversation, ConversationTurns

SEED_MASK = (1 << 62) - 1  # the engine's prompt seeds are in [0, 2^62)
# decode steps the first of a group of re-entries waits for the others (24: the best of 0/8/24
# on the H100 agentic bench, docs/PERFORMANCE.md)
REENTRY_WAIT_STEPS = 24


def turn_seed(c: Conversation) -> int | None:
    """The draw seed of ``c``'s next turn (None: unseeded)."""
    return None if c.seed is None else row_seed(c.seed, c.turns) & SEED_MASK


def supports_async(engine) -> bool:
    """Whether ``engine`` (a rollout engine) can run turns as continuous-engine requests."""
    return callable(getattr(engine, "continuous_engine", None)) and hasattr(engine, "keep_kv")


class AsyncTurns:
    """``AsyncTurns(turns, engine)``: ``engine`` a
    :class:`~parallel_models.inference.RolloutEngine` (its continuous engine is used, planned
    like ``kv_budget_tokens="auto"`` when the engine batches statically);
    ``reentry_wait_steps``: see the module's docstring (0: each re-entry at once)."""

    def __init__(self, turns: ConversationTurns, engine,
                 reentry_wait_steps: int = REENTRY_WAIT_STEPS):
        self.turns, self.engine = turns, engine
        self.reentry_wait_steps = reentry_wait_steps
        layout = getattr(engine, "parallel_layout", None)
        self.tp = 1 if layout is None else layout.tensor_parallel_size
        self.layout = layout
        self.leader = self.tp == 1 or layout.tensor_parallel_rank == 0
        self.idle_seconds = 0.0  # waiting for a tool with no row decoding and none to re-enter

    def run(self, conversations: list[Conversation], one, max_new_tokens: int) -> float:
        """Generate every conversation to its end; ``one`` the turn's sampling params (n=1).
        Returns the tools' seconds."""
        cont = self._open(conversations)
        self.turns.stop_ids = set(self.engine.stop_ids(one))
        finished: collections.deque = collections.deque()  # (conversation index, request)
        waiting: dict[int, tuple] = {}  # conversation index -> (TurnEnd, future | None)
        held: list[int] = []  # conversations ready to re-enter, since step `held_since`
        held_since = 0
        kept: dict = {}  # conversation index -> its last turn's kept KV region
        seconds = 0.0
        try:
            for i, c in enumerate(conversations):
                self._submit(cont, finished, kept, i, c, one, max_new_tokens)
            while not all(c.done for c in conversations):
                if cont.has_work:
                    cont.step()
                while finished:
                    i, req = finished.popleft()
                    kept[i] = getattr(req, "kept", None)
                    sample = req.samples[0]
                    end = self.turns.end_turn(conversations[i], {
                        "token_ids": sample.token_ids, "log_probs": sample.log_probs})
                    future = self.turns.run_tools(end) if self.leader else None
                    waiting[i] = (end, future)
                if waiting:
                    block = not cont.has_work and not held
                    start = time.perf_counter()
                    ready = self._ready(waiting, block=block)
                    if block:
                        self.idle_seconds += time.perf_counter() - start
                    for i, records in ready:
                        c = conversations[i]
                        end, _ = waiting.pop(i)
                        seconds += self.turns.after_tools(c, end, records)
                        if c.done:
                            self._release(cont, kept.pop(i, None))
                        elif self._fed_in_decode(cont, kept.get(i), c):
                            self._submit(cont, finished, kept, i, c, one, max_new_tokens)
                        else:
                            held_since = held_since if held else cont.steps
                            held.append(i)
                if held and (not cont.has_work
                             or cont.steps - held_since >= self.reentry_wait_steps):
                    for i in held:
                        self._submit(cont, finished, kept, i, conversations[i], one,
                                     max_new_tokens)
                    held.clear()
        finally:
            for region in kept.values():
                self._release(cont, region)
            if not self.engine.keep_kv:
                self.engine._continuous = None
        return seconds

    @staticmethod
    def _fed_in_decode(cont, region, c: Conversation) -> bool:
        """Whether ``c``'s re-entry would run in a decode step (its kept region still there and
        few new tokens), so gathering it with others saves nothing."""
        feeds = getattr(cont, "feeds", None)  # (None: an engine without it)
        return feeds is not None and region is not None and region.live \
            and feeds(len(c.context) - region.length)

    @staticmethod
    def _release(cont, region) -> None:
        if region is not None:
            cont.release_kept(region)

    def _open(self, conversations: list[Conversation]):
        limits = self.turns.limits
        longest_row = None  # unknown without a total budget: as long as the model allows
        if limits.max_total_tokens is not None:
            longest_row = max(c.prompt_length for c in conversations) + limits.max_total_tokens
        budget = None if getattr(self.engine, "continuous", False) else "auto"
        return self.engine.continuous_engine(max(len(c.context) for c in conversations),
                                             longest_row, len(conversations),
                                             kv_budget_tokens=budget)

    def _submit(self, cont, finished, kept: dict, i: int, c: Conversation, one,
                max_new_tokens: int) -> None:
        cap = min(self.turns.turn_cap(c, max_new_tokens), cont.max_row_tokens - len(c.context))
        if cap < 1:  # the conversation fills a row of the engine: no room for another turn
            c.cuts.add("total_tokens")
            c.done = True
            self._release(cont, kept.pop(i, None))
            return
        params = one.model_copy(update={"max_new_tokens": cap, "seed": turn_seed(c)})
        cont.submit(c.context, params, stop_ids=self.turns.stop_ids,
                    stop_sequences=self.turns.stop_sequences,
                    on_done=lambda req, i=i: finished.append((i, req)),
                    keep_kv=True, resume=kept.pop(i, None))

    def _ready(self, waiting: dict, block: bool) -> list[tuple[int, list]]:
        """The waiting conversations whose tools finished, with their records, in index order
        (``block``: wait for at least one); the same on every TP rank (TP rank 0's)."""
        ready = None
        if self.leader:
            ready = self._local_ready(waiting)
            if not ready and block:
                cf.wait([f for _, f in waiting.values() if f is not None],
                        return_when=cf.FIRST_COMPLETED)
                ready = self._local_ready(waiting)
        if self.tp > 1:
            box = [ready]
            dist.broadcast_object_list(box, src=self.layout.tensor_parallel_src_rank,
                                       group=self.layout.tp_group)
            ready = box[0]
        return ready

    @staticmethod
    def _local_ready(waiting: dict) -> list[tuple[int, list]]:
        return [(i, [] if f is None else f.result()) for i, (_, f) in sorted(waiting.items())
                if f is None or f.done()]


__all__ = ["AsyncTurns", "SEED_MASK", "supports_async", "turn_seed"]
