"""Asynchronous RL (``trainer.mode=async``): a rollout server generates the next steps' samples
into a bounded queue while the trainer trains on the current ones.

- ``fleet.py``: the rollout server the trainer starts (or the fleet at ``rollout.server_url``);
- ``versions.py``: the trainer's policy versions as the server numbers its weights, and the
  staleness of a sample (trainer version - the version that drew it);
- ``producer.py``: the prompts of each step as the trainer's loader will hand them out, and the
  threads that ask the server for them, each step as soon as ``max_staleness`` allows (several
  steps' requests in flight together), handed to the trainer in order;
- ``rollout.py``: the rollout the trainer sees (the rollout interface): its ``generate`` takes
  the step's samples from the queue (a stale one regenerated or dropped), its
  ``update_weights`` pushes the new weights (a one-process trainer: off its critical path,
  ``inference/server/background_push.py``) and lets the producer go on, ``metrics`` the step's
  ``async/...`` numbers.
"""
