"""The replica process: serves one engine over OpenAI-compatible HTTP, with health and metrics."""
