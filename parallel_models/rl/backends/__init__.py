"""Training backends (``parallel.backend``): each builds the run's roles (actor, reference,
critic, reward, rollout) as one ``roles.Roles`` and exports the trained models; they are found by
name in ``registry.TRAINING_BACKENDS``: ``megatron`` (our parallel models) and ``fsdp``
(transformers models under FSDP2)."""
