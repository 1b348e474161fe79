"""Multi-LoRA serving: PEFT adapters in a bounded set of slots, applied per row of a batch."""
