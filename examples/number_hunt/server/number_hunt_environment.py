# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""
Number Hunt Environment Implementation.

A guessing game that needs its feedback: the environment picks a whole number from 1 to
``HIGH`` (from the seed ``reset`` is given, so a seed is a game), and the player has
``GUESSES`` guesses. Each reply's first whole number is the guess; the game answers
"Higher." or "Lower.", and ends with reward 1 on the right number or 0 when the guesses
run out. A reply with no number costs a guess. Without the feedback at most GUESSES/HIGH
of the games can be won; halving the range on each answer wins them all.
"""

import random
import re
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State

try:
    from ..models import NumberHuntAction, NumberHuntObservation
except ImportError:
    from models import NumberHuntAction, NumberHuntObservation

HIGH = 10
GUESSES = 4
RULES = (f"I am thinking of a whole number from 1 to {HIGH}. You have {GUESSES} guesses. "
         "After each guess I say whether my number is higher or lower. Reply with one number.")


class NumberHuntEnvironment(Environment):
    """
    The guessing game, one per session.

    Example:
        >>> env = NumberHuntEnvironment()
        >>> obs = env.reset(seed=3)
        >>> obs = env.step(NumberHuntAction(guess="5"))
        >>> print(obs.message)  # "Higher." or "Lower." or "Right! ..."
    """

    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self):
        """Initialize the number_hunt environment."""
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._secret = 1

    def reset(self, seed=None, episode_id=None, **kwargs) -> NumberHuntObservation:
        """A new game: the hidden number drawn from ``seed`` (any when there is none)."""
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self._secret = random.Random(seed).randint(1, HIGH)
        return NumberHuntObservation(message=RULES, guesses_left=GUESSES, done=False, reward=0.0)

    def step(self, action: NumberHuntAction, timeout_s=None, **kwargs) -> NumberHuntObservation:
        """One guess: right ends the game with reward 1; otherwise higher or lower, and the
        game ends with reward 0 when no guess is left."""
        self._state.step_count += 1
        left = GUESSES - self._state.step_count
        found = re.search(r"\d+", action.guess)
        guess = int(found.group()) if found else None
        if guess == self._secret:
            return NumberHuntObservation(message=f"Right! It was {self._secret}.", guesses_left=left, done=True,
                                         reward=1.0)
        if guess is None:
            message = f"Reply with one number from 1 to {HIGH}."
        else:
            message = "Higher." if self._secret > guess else "Lower."
        if left <= 0:
            return NumberHuntObservation(message=f"{message} No guesses left: it was {self._secret}.",
                                         guesses_left=0, done=True, reward=0.0)
        return NumberHuntObservation(message=message, guesses_left=left, done=False, reward=0.0)

    @property
    def state(self) -> State:
        """
        Get the current environment state.

        Returns:
            Current State with episode_id and step_count
        """
        return self._state
