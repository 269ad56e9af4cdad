"""A labelled reward of one's own, in TRL's shape: lists of length G in, G floats out.

Full credit for the exact answer, partial credit for the right number of digits (a shaped
reward); the task extracts each completion's answer (``extracted``) and passes the row's
reference answer repeated (``reference``, also ``answer``). See docs/extending.md.

    pipeline up --trainer.steps 4 --verifier.reward examples/my_reward.py:exact_or_length

(the embedded defaults: configs/tiny.toml tunes the label model, which a labelled reward does not use)
"""

from __future__ import annotations


def exact_or_length(prompts, completions, reference, extracted, **kw) -> list[float]:
    out = []
    for e, r in zip(extracted, reference):
        if e is None:
            out.append(0.0)
        elif e == r:
            out.append(1.0)
        else:
            out.append(0.2 if len(e.lstrip("-")) == len(r.lstrip("-")) else 0.0)
    return out
