"""The HTTP surface shared by the worker and the gateway: OpenAI protocol schemas and errors."""
