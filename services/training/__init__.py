"""Model building: the default pair (tokenizer, target, DFlash drafter, assistant) trained here, tiny pairs for
tests, and the drafter's distillation."""
