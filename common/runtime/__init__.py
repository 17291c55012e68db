"""The runtime: what runs a model on a device: the runners (eager, CUDA captured steps), the backend choice, tensor
parallelism, device and threads, memory footprints, and the sampling maths over logits (distributions)."""
