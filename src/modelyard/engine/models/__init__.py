"""Model definitions (the Llama family) and their loaders (Hugging Face folders, GGUF files)."""
