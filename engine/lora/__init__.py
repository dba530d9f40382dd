"""LoRA adapters: PEFT-format loading, resident slots with LRU loading, per-row batched deltas."""
