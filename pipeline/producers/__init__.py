"""Producers: the feeder (prompts) and the generators (rollout groups)."""
