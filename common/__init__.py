"""Code shared by two or more services, in layers (docs/architecture.md#layers-and-import-rules): kernels, models,
runtime, wire, telemetry and tokens as packages; contracts, config, sampling, prompts, argtypes and errors as modules
at its top level. Imports no service."""
