"""Forget/retain data: sources (JSON lines, hub), prompt formatting and label masks, batches."""
