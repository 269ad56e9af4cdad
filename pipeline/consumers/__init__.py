"""Consumers: the verifiers (rewards) and the trainer (policy updates)."""
