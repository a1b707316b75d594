"""Megatron-Core GPT models for actor, reference and critic: specs, heads, HF bridge, canonical weights."""
