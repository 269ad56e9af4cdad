# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Number Hunt Environment Client."""

from typing import Dict

from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server.types import State

from .models import NumberHuntAction, NumberHuntObservation


class NumberHuntEnv(
    EnvClient[NumberHuntAction, NumberHuntObservation, State]
):
    """
    Client for the Number Hunt Environment.

    This client maintains a persistent WebSocket connection to the environment server,
    enabling efficient multi-step interactions with lower latency.
    Each client instance has its own dedicated environment session on the server.

    Example:
        >>> # Connect to a running server
        >>> with NumberHuntEnv(base_url="http://localhost:8000") as client:
        ...     result = client.reset()
        ...     print(result.observation.message)
        ...
        ...     result = client.step(NumberHuntAction(guess="5"))
        ...     print(result.observation.message)

    Example with Docker:
        >>> # Automatically start container and connect
        >>> client = NumberHuntEnv.from_docker_image("number_hunt-env:latest")
        >>> try:
        ...     result = client.reset()
        ...     result = client.step(NumberHuntAction(guess="5"))
        ... finally:
        ...     client.close()
    """

    def _step_payload(self, action: NumberHuntAction) -> Dict:
        """
        Convert NumberHuntAction to JSON payload for step message.

        Args:
            action: NumberHuntAction instance

        Returns:
            Dictionary representation suitable for JSON encoding
        """
        return {
            "guess": action.guess,
        }

    def _parse_result(self, payload: Dict) -> StepResult[NumberHuntObservation]:
        """
        Parse server response into StepResult[NumberHuntObservation].

        Args:
            payload: JSON response data from server

        Returns:
            StepResult with NumberHuntObservation
        """
        obs_data = payload.get("observation", {})
        observation = NumberHuntObservation(
            message=obs_data.get("message", ""),
            guesses_left=obs_data.get("guesses_left", 0),
            done=payload.get("done", False),
            reward=payload.get("reward"),
            metadata=obs_data.get("metadata", {}),
        )

        return StepResult(
            observation=observation,
            reward=payload.get("reward"),
            done=payload.get("done", False),
        )

    def _parse_state(self, payload: Dict) -> State:
        """
        Parse server response into State object.

        Args:
            payload: JSON response from state request

        Returns:
            State object with episode_id and step_count
        """
        return State(
            episode_id=payload.get("episode_id"),
            step_count=payload.get("step_count", 0),
        )
