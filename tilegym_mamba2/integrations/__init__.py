"""Integrations with other libraries' models: hf/ for Hugging Face transformers."""
