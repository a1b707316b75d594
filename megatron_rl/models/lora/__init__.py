"""LoRA: low-rank adapters on the frozen base (:mod:`.adapters`), their export to peft (:mod:`.export`)."""
