"""Ways in from the frameworks people already train with (Hugging Face Trainer, ...)."""
