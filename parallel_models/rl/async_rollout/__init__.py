"""Asynchronous RL (``trainer.mode=async``): a rollout server generates the next steps' samples
into a bounded queue while the trainer trains on the current ones.

- ``fleet.py``: the rollout server the trainer starts (or the fleet at ``rollout.server_url``);
- ``versions.py``: the trainer's policy versions as the server numbers its weights, and the
  staleness of a sample (trainer version - the version that drew it);
- ``producer.py``: the prompts of each step as the trainer's loader will hand them out, and the
  thread that asks the server for them into the queue, never ahead of ``max_staleness``;
- ``rollout.py``: the rollout the trainer sees (the rollout interface): its ``generate`` takes
  the step's samples from the queue (a stale one regenerated or dropped), its
  ``update_weights`` pushes the new weights and lets the producer go on, ``metrics`` the step's
  ``async/...`` numbers.
"""
