"""modelyard: a self-hostable AI inference platform with its own LLM engine."""

__version__ = "0.1.0"
