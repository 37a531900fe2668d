"""The second training backend (``parallel.backend=fsdp``): plain transformers models sharded
with torch FSDP2 (``fully_shard`` per decoder layer on a data-parallel device mesh), behind the
same roles API as the megatron backend (``rl/roles/model_roles.py``).

One concern per module: ``models`` (load and shard HF models, the critic's value model),
``forward`` (packed or padded forwards to per-token outputs in packed order), ``optim`` (AdamW,
clipping over the mesh, megatron's LR schedule), ``roles`` (actor / reference / critic),
``rollout_sync`` (our CausalLM for generation, filled layer by layer from FSDP gathers),
``hf_rollout`` (generation with the HF model itself for families our registry lacks),
``checkpoint`` (torch.distributed.checkpoint save / resume, HF export), ``lora`` (the actor
under peft's LoRA: merged refills, PEFT export) and ``factory`` (what the trainer calls).
"""
