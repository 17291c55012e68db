"""Code shared by two or more services: the role contracts, config, models and the runner, kernels, sampling,
tensor sharing, auth, telemetry. Imports no service."""
