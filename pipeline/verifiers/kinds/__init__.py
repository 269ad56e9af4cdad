"""Verifier kinds heavier than the rule-based checks of ``pipeline.verifiers.registry``.

Each module exposes ``build(arg: str | None) -> Verifier`` and is imported only when a
spec names its kind (``pipeline.verifiers.registry.KINDS``), so the optional dependencies
(``math-verify``, a reward-model checkpoint) cost nothing to a run that does not use them.
"""
