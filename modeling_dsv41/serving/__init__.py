"""A fine-tune in the layouts serving engines read: LoRA adapters for vLLM's DeepSeek-V4 LoRA
(:mod:`.adapter_export`)."""
