# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""
Data models for the Number Hunt Environment.

The number_hunt environment is a guessing game: the player guesses a hidden whole number
and is told after each guess whether it is higher or lower.
"""

from openenv.core.env_server.types import Action, Observation
from pydantic import Field


class NumberHuntAction(Action):
    """Action for the Number Hunt environment - the player's guess, as text."""

    guess: str = Field(..., description="The player's reply; its first whole number is the guess")


class NumberHuntObservation(Observation):
    """Observation from the Number Hunt environment - what the game says."""

    message: str = Field(default="", description="The game's reply: the rules, higher, lower or the result")
    guesses_left: int = Field(default=0, description="Guesses the player has left")
