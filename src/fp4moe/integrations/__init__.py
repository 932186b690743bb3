"""Integrations with other libraries; each is imported on its own (``fp4moe.integrations.transformers``)."""
