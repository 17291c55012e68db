"""The DFlash-2 block drafter: its config, model, checkpoint format, draft vocabulary and CPU kernels."""
