"""The router role: the public gRPC and HTTP APIs, the scheduler, the step loop and its clients of the remote
roles. Holds no model."""
