"""Training machinery around Megatron-Core: DDP, optimizer, pipeline schedules, checkpoints."""
