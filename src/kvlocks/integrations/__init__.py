"""Integrations with serving and modelling libraries (Hugging Face transformers; vLLM later)."""
