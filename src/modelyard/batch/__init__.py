"""Batch inference: the OpenAI Files and Batches APIs, validation, the durable runner, webhooks."""
