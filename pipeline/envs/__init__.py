"""Environments for multi-turn episodes: the contract the generator drives, and the built-in ones."""
