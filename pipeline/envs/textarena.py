"""``env.kind = "textarena"`` / ``"textarena:<game id>"``: a single-player TextArena game, in process.

`TextArena <https://github.com/LeonGuertler/TextArena>`_ (PyPI ``textarena`` 0.7.4, the
``textarena`` extra) is a collection of text games with one interface: ``reset(num_players,
seed)``, ``get_observation()``, ``step(action) -> (done, info)``, ``close() -> (rewards,
game info)``. An episode here is one game played by the model alone:

- **reset**: the game is made (its ``-raw`` version: no textarena wrappers, so each observation
  is only what is new) and reset for one player with the group's seed (``reset(seed=...)``,
  from the run's ``feeder.seed`` and the prompt's id: pipeline.envs.base.episode_seed; without
  one, a seed derived from the prompt's id alone, ``crc32``), so the completions of a group
  play the same game and the groups different ones. The first observation is the game's opening messages (its rules and what to do).
- **step(action)**: the turn's text is the game action (``GuessTheNumber`` reads the number in
  square brackets, ``[7]``); the observation is the game's messages since the last turn, one
  line each as ``[GAME] ...`` (the model's own action is not repeated: it is already in the
  sequence). An invalid move is answered by the game's own warning (textarena allows one in
  a row; the next ends the game).
- **reward and done**: when the game says it is over, the step is done and its reward is
  textarena's reward for player 0 (``close()``'s rewards): for ``GuessTheNumber`` 1 for the
  right number, else how close the last guess was (0 to 1). Before that, no reward; an
  episode the pipeline ends first (``env.max_turns``, the token budget) is unrewarded.

Only games for one player that run offline work: the default, ``GuessTheNumber-v0`` (a number
from 1 to 20 in 10 guesses), is tested; a game for more players, or one that downloads data
(the word games fetch nltk corpora), is refused when the factory is built (before launch),
naming env.kind. textarena seeds Python's global ``random`` in reset; resets here hold a lock
and put the global generator's state back afterwards.

textarena is imported only when this environment is used; without it the factory raises
naming env.kind and the extra to install.
"""

from __future__ import annotations

import difflib
import random
import threading
import zlib
from typing import Any

from pipeline.envs.base import EnvError, Step

DEFAULT_GAME = "GuessTheNumber-v0"
"""The game of ``env.kind = "textarena"``."""
PREFIX = "textarena"
VERSION = "0.7.4"

_RESET_LOCK = threading.Lock()


def game_of(kind: str) -> str:
    """The game id an ``env.kind`` names (``textarena`` alone: :data:`DEFAULT_GAME`)."""
    if kind == PREFIX:
        return DEFAULT_GAME
    if not kind.startswith(PREFIX + ":") or not kind[len(PREFIX) + 1:].strip():
        raise EnvError(f"env.kind {kind!r}: a TextArena game is named textarena or textarena:<game id> "
                       f"(e.g. textarena:{DEFAULT_GAME})")
    return kind[len(PREFIX) + 1:].strip()


def require(kind: str = PREFIX) -> Any:
    """The ``textarena`` module, or EnvError naming env.kind and how to install it."""
    try:
        import textarena
    except ImportError as e:
        raise EnvError(f"env.kind {kind!r} needs textarena {VERSION}, the `textarena` extra "
                       f"(pip install -e '.[textarena]'; docs/environments.md): {e}") from e
    return textarena


def registry_id(game: str, kind: str) -> str:
    """The registered id to make: the game's ``-raw`` version (no wrappers) where it has one."""
    from textarena.envs.registration import ENV_REGISTRY

    if game not in ENV_REGISTRY:
        close = difflib.get_close_matches(game, list(ENV_REGISTRY), n=5, cutoff=0.6)
        hint = f"close ids: {', '.join(close)}" if close else f"e.g. {DEFAULT_GAME}"
        raise EnvError(f"env.kind {kind!r}: textarena {VERSION} has no game {game!r}; {hint}")
    raw = game if game.endswith("-raw") else f"{game}-raw"
    return raw if raw in ENV_REGISTRY else game


def seed_of(prompt_id: str) -> int:
    """The game seed of a prompt: the same for every completion of its group, in every process."""
    return zlib.crc32(f"textarena:{prompt_id}".encode())


def render(messages) -> str:
    """The text of textarena messages for the model: the game's, one line each; the player's own
    actions left out (they are already in the sequence)."""
    import textarena as ta

    lines = []
    for message in messages or ():
        sender, text = message[0], message[1]
        kind = message[2] if len(message) > 2 else None
        if kind == ta.ObservationType.PLAYER_ACTION or (sender != ta.GAME_ID and kind is None):
            continue
        if kind == ta.ObservationType.PROMPT:
            lines.append(str(text).strip())
        else:
            lines.append(f"[GAME] {str(text).strip()}")
    return "\n" + "\n".join(lines) + "\n" if lines else ""


class TextArenaEpisode:
    """One single-player game (the module docstring)."""

    def __init__(self, game: str, seed: int, *, kind: str = PREFIX) -> None:
        ta = require(kind)
        self.kind, self.game, self.seed = kind, game, seed
        self.env = ta.make(registry_id(game, kind))
        self.done = False
        self.reward: float | None = None
        self.info: dict = {}

    def reset(self, seed: int | None = None) -> str:
        """The game's opening messages, the game reset with ``seed`` (default: the one it was made with)."""
        if seed is not None:
            self.seed = seed
        with _RESET_LOCK:  # textarena seeds the global random: one reset at a time, its state put back
            saved = random.getstate()
            try:
                self.env.reset(num_players=1, seed=self.seed)
            except AssertionError as e:  # the state's own check: a game for more players
                raise EnvError(f"env.kind {self.kind!r}: {self.game} is not a single-player game ({e})") from None
            finally:
                random.setstate(saved)
        return self._observation()

    def _observation(self) -> str:
        _, messages = self.env.get_observation()
        return render(messages)

    def step(self, action: str) -> Step:
        if self.done:
            raise EnvError(f"env.kind {self.kind!r}: a step after the game ended")
        done, _ = self.env.step(action)
        if not done:
            return Step(observation=self._observation(), reward=None, done=False)
        self.done = True
        rewards, info = self.env.close()
        self.info = dict(info.get(0, {})) if isinstance(info, dict) else {}
        value = rewards.get(0) if isinstance(rewards, dict) else None
        self.reward = None if value is None else float(value)
        return Step(observation="", reward=self.reward, done=True)

    def close(self) -> None:
        pass


class TextArenaGames:
    """The factory of ``env.kind = "textarena[:<game id>]"``: checks once, when built, that textarena
    is installed, knows the game, and can play it alone offline (one game made and reset)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.game = game_of(kind)
        require(kind)
        registry_id(self.game, kind)
        try:
            TextArenaEpisode(self.game, 0, kind=kind).reset()
        except EnvError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the game raises when it cannot start here
            why = " ".join(str(e).split())[:300]
            raise EnvError(f"env.kind {kind!r}: {self.game} does not start for one player here "
                           f"({type(e).__name__}: {why}); pick a single-player game that runs offline, e.g. "
                           f"textarena:{DEFAULT_GAME}") from None

    def __call__(self, task) -> TextArenaEpisode:
        return TextArenaEpisode(self.game, seed_of(task.prompt_id), kind=self.kind)


def textarena(cfg) -> TextArenaGames:
    """The factory ``make_env`` returns for ``env.kind = "textarena[:<game id>]"``."""
    return TextArenaGames(cfg.env.kind)
