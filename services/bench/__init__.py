"""Measurement: `blockspec bench` (speculative vs plain decoding vs transformers, side by side, with the cost
model) and `blockspec gpu-check`."""
