"""Encoder models (embeddings, sequence classifiers) served with dynamic batching, several models
per process within a memory budget."""
