"""An asynchronous RL post-training pipeline for LLMs over durable Redis streams.

::

  dataset ─► feeder ─► {ns}:prompts ─► generator ×N ─► {ns}:rollouts ─► verifier ×M ─► {ns}:scored ─► trainer
                                          ▲                                                            │
                                          └──────── versioned weights (shm / tcp / ucx) ◄───────────────┘

Every stage is its own OS process (``pipeline feed|generate|verify|train``, and the optional
eval worker ``pipeline evaluate``) reading a stream through a consumer group and acking only
after its output is written, so any stage can be scaled out or killed without losing a
rollout. Package map (``docs/layout.md`` has the whole tree):

- ``config``   run configuration (TOML + dotted overrides), validated, frozen after load; its
               sections in ``config_*``; ``inert`` (fields that cannot take effect), ``registry``
               and ``catalog`` (the names of tasks, losses, transports, environments)
- ``keys``     every Redis key, documented in one place (S shards; S = 1 the ordinary case)
- ``records``  the frozen MessagePack records of each stage transition
- ``stage``    the stream plumbing of a stage (read, decode and check, emit + ack in one
               transaction, dead letters, trim) and the loop the verifier and the batch
               generator run on it
- ``api``      a small Python API over the stages' own parts, for loops written by hand
- ``plugins``  user code named in the config (``module:attr`` specs, entry points)
- ``bus/``     connection, streams (readers, dead letters, trim), flow (admission, stop,
               backpressure), stats, the embedded server
- ``producers/``  feeder, generator;  ``consumers/``  verifier, trainer, evaluator
- ``algo/``    the objective (losses), rewards, the Weaver label model, the score model,
               selection, distillation
- ``verifiers/``  weak verifiers (registry, arithmetic, math, kinds/, the judge server)
- ``tasks/``   prompt sources and their hidden truth (arithmetic, math, code, reasoning-gym)
- ``envs/``    environments for multi-turn episodes (calculator, code, TextArena, OpenEnv)
- ``engines/`` tensor work behind the stages (torch, vllm, torchtitan, LoRA, held-out episodes)
- ``weights/`` versioned weight publication and fetching (shm, tcp, ucx)
- ``model/``   tokenizers, the tiny Qwen3 policy, pretraining, init-model, import
- ``common/``  below every stage: checkpoints and their commit records, recorded processes, the
               sandbox, Hugging Face files
- ``run/``     the single-machine driver (plan, preflight, base model, supervisor, summary, down),
               chaos, accounting
- ``observe/`` logs, metrics, tracking, top, dashboard, report, ``pipeline eval``;  ``cli``  the
               command table
"""
