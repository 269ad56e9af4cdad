"""What every level shares, importing nothing else of the project: trainer checkpoints, the rollout
archive's files, the pids a run recorded, the sandbox for untrusted code, the JSON files of an HF
checkpoint directory."""
