"""The LLM engine: continuous batching over a paged, prefix-cached KV cache.

Knows nothing of HTTP, tenants or databases. `LLMEngine` is the synchronous core;
`AsyncEngine` runs it in a background thread and gives each request an async stream.
"""
