"""Integrations with serving stacks and model libraries (vLLM, transformers)."""
