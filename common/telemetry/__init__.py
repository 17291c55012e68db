"""Telemetry: metric instruments and process readings (metrics), span names and the OTLP setup (tracing)."""
