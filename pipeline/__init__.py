"""An asynchronous RL post-training pipeline for LLMs over durable Redis streams.

::

  dataset ─► feeder ─► {ns}:prompts ─► generator ×N ─► {ns}:rollouts ─► verifier ×M ─► {ns}:scored ─► trainer
                                          ▲                                                            │
                                          └──────────── versioned weights (shm / tcp) ◄────────────────┘

Every stage is its own OS process (``pipeline feed|generate|verify|train``) reading a
stream through a consumer group and acking only after its output is written, so any
stage can be scaled out or killed without losing a rollout. Package map (``docs/layout.md`` has the whole tree):

- ``config``   run configuration (TOML + dotted overrides), validated, frozen after load
- ``keys``     every Redis key, documented in one place (S shards; S = 1 the ordinary case)
- ``records``  the frozen MessagePack records of each stage transition
- ``stage``    the one loop every stream stage runs: claim, process, emit + ack, trim
- ``bus/``     connection, streams (readers, dead letters, trim), flow (admission, stop,
               backpressure), stats, the embedded server
- ``producers/``  feeder, generator;  ``consumers/``  verifier, trainer
- ``algo/``    the objective (losses), rewards, the Weaver label model, distillation
- ``verifiers/``  weak verifiers (registry, arithmetic, math, kinds/)
- ``tasks/``   prompt sources and their hidden truth (arithmetic, math)
- ``engines/`` tensor work behind the stages (torch, vllm, torchtitan)
- ``weights/`` versioned weight publication and fetching (shm, tcp, ucx)
- ``model/``   tokenizers, the tiny Qwen3 policy, pretraining, init-model
- ``run/``     the single-machine driver, chaos, accounting, checkpoints
- ``observe/`` logs, metrics, top, dashboard, report;  ``cli``  the command table
"""
