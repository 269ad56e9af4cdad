"""Chat-native episodes (pipeline.envs.chat): with a chat model, every observation is a turn of
the checkpoint's chat template, the reset text a user turn before the model's first.

The real SmolLM2-135M-Instruct plays scripted environments through the held-out player
(pipeline.engines.episodes.play), the generator's own pieces (the slot sampler and the
episode runner) and the generator stage (feeder and streamer on a real Redis-compatible
server): the token stream each builds (prompt, sampled turns, observations)
is the tokenisation of the template's rendering of the same conversation, observation
tokens are masked and sampled ones are not. A template-less tokenizer keeps the raw form.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeline.bus.connection import connect
from pipeline.config import EnvConfig, RunConfig
from pipeline.engines.episodes import play
from pipeline.engines.slots import SlotSampler
from pipeline.envs.base import EpisodeRunner, Step, encode_text
from pipeline.envs.chat import ChatTemplateError, ChatTurns
from pipeline.keys import Keys
from pipeline.model.qwen import load_checkpoint
from pipeline.model.tokenizer import CharTokenizer, load_tokenizer
from pipeline.producers.feeder import run_feeder
from pipeline.producers.generator import Generator, Streamer
from pipeline.records import PromptTask, RolloutGroup
from pipeline.tasks.prompting import PLAIN, PromptFormat, build_prompt, checkpoint_format, render_chat
try:
    from builders import RecordingLog
except ImportError:  # this file imported by path as an env.kind plugin (pipeline up), outside pytest
    RecordingLog = None

SMOLLM2 = Path(__file__).resolve().parents[1] / "artifacts" / "smollm2-135m-instruct"
needs_smollm2 = pytest.mark.skipif(not (SMOLLM2 / "model.safetensors").is_file(),
                                   reason=f"no imported SmolLM2-135M-Instruct at {SMOLLM2} "
                                          "(pipeline import-model smollm2-135m-instruct)")
QUESTION = "Guess my number. Answer with one word."


pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.one_server]


@pytest.fixture(scope="module")
def smollm2():
    model, tok = load_checkpoint(SMOLLM2)
    return model.eval(), tok


class Scripted:
    """An episode whose reset text and answers are fixed: a user observation, then a tool
    observation (the step a tool call), then done."""

    def __init__(self, reset: str = "I am thinking of an integer."):
        self.reset_text, self.actions = reset, []

    def reset(self) -> str:
        return self.reset_text

    def step(self, action: str) -> Step:
        self.actions.append(action)
        if len(self.actions) == 1:
            return Step(observation="Too low. Try again.")
        if len(self.actions) == 2:
            return Step(observation="result = 42", tool_call=True)
        return Step(observation="", reward=1.0, done=True)

    def close(self) -> None:
        pass


def _turns(completion: list[int], mask: list[int]) -> list[tuple[bool, list[int]]]:
    """The completion as runs of (sampled, ids)."""
    out: list[tuple[bool, list[int]]] = []
    for t, m in zip(completion, mask):
        if out and out[-1][0] == bool(m):
            out[-1][1].append(t)
        else:
            out.append((bool(m), [t]))
    return out


def _conversation(reset: str, actions: list[str], *, system: str = "") -> list[dict[str, str]]:
    """The conversation an episode of :class:`Scripted` is: the task's user message, the reset
    text as a user turn, then the model's turns and the environment's answers."""
    msgs = [{"role": "system", "content": system}] if system else []
    msgs += [{"role": "user", "content": QUESTION}]
    if reset:
        msgs.append({"role": "user", "content": reset})
    answers = [("user", "Too low. Try again."), ("tool", "result = 42")]
    for action, (role, text) in zip(actions, answers):
        msgs += [{"role": "assistant", "content": action}, {"role": role, "content": text}]
    return msgs


@needs_smollm2
def test_the_held_out_player_builds_the_templates_rendering_of_the_conversation(smollm2):
    """Three turns of the real model: reset text, a user observation, a tool observation. The
    prompt and completion are the tokenisation of the chat template's rendering of the
    conversation (with the generation prompt), plus the final turn the model sampled."""
    model, tok = smollm2
    fmt = checkpoint_format(SMOLLM2)
    chat = ChatTurns.of(fmt, tok)
    _, prompt = build_prompt(fmt, tok, QUESTION)
    envs: list[Scripted] = []

    def factory(task):
        envs.append(Scripted())
        return envs[-1]

    (p,) = play(model, tok, [prompt], ["42"], factory, max_turns=3, max_new_tokens=160, chat=chat)
    env = envs[0]
    assert p.error is None and p.turns == 3 and p.reward == 1.0 and len(env.actions) == 3
    stream = p.prompt + p.completion
    assert stream[-1] == tok.eos_id
    expected = tok.encode(render_chat(fmt.chat_template, _conversation(env.reset_text, env.actions[:2]),
                                      **dict(fmt.special_tokens)))
    assert stream[: len(expected)] == expected  # then the model's final turn
    assert tok.decode(stream[len(expected):]) == env.actions[2] and stream[len(expected):].count(tok.eos_id) == 1
    assert p.prompt == list(prompt[: -len(chat.generation_ids)])  # the generation prompt went to the first turn
    transcript = tok._tok.decode(stream, skip_special_tokens=False)
    assert "<|im_start|>user\nI am thinking of an integer.<|im_end|>\n<|im_start|>assistant\n" in transcript
    assert "<|im_end|>\n<|im_start|>tool\nresult = 42<|im_end|>\n<|im_start|>assistant\n" in transcript


@needs_smollm2
def test_the_generators_episodes_are_template_turns_with_each_episodes_own_reset_masked(smollm2):
    """The generator's pieces (the episode runner's threads, the slot sampler): a group of
    three episodes, each with its own reset text (one empty), with a system prompt. Each
    completion after the group's prompt is its own conversation's rendering; observation
    tokens carry mask 0 and no log-prob, the sampled ones mask 1."""
    model, tok = smollm2
    fmt = checkpoint_format(SMOLLM2, system_prompt="Be brief.")
    chat = ChatTurns.of(fmt, tok)
    text, prompt = build_prompt(fmt, tok, QUESTION)
    resets = iter(["Round one.", "", "Round three: a harder one."])
    made: list[Scripted] = []

    def factory(task):
        made.append(Scripted(next(resets)))
        return made[-1]

    runner = EpisodeRunner(factory, EnvConfig(), tok, RecordingLog(), chat=chat)
    task = PromptTask(prompt_id="p", prompt=text, prompt_ids=prompt, reference="42", issued_at=0.0)
    firsts = runner.start("k", task, 3)
    group_prompt = runner.prompt("k", task.prompt_ids)
    sampler = SlotSampler(model, slots=3, temperature=0.0, eos_id=tok.eos_id, pad_id=tok.pad_id)
    fin = sampler.add("k", group_prompt, n=3, max_new_tokens=160, version=0, observations=firsts)
    sampler.set_max_turns("k", 3)
    while fin is None:
        for f in sampler.step(0):
            fin = f
        for key, j, action in sampler.turn_ended():
            runner.submit(key, j, tok.decode(action))
        while runner.waiting:
            for key, j, obs, ended in runner.collect(1.0):
                fin = sampler.observe(key, j, obs, done=ended, version=0) or fin
    assert runner.finish("k", 3) == [1.0, 1.0, 1.0]
    assert list(group_prompt) == list(prompt[: -len(chat.generation_ids)])
    for j, env in enumerate(made):
        tokens, mask, logprobs = fin.tokens[j], fin.masks[j], fin.logprobs[j]
        assert fin.turns[j] == 3
        runs = _turns(tokens, mask)
        assert [sampled for sampled, _ in runs] == [False, True, False, True, False, True]
        assert all(ids[-1] == tok.eos_id for sampled, ids in runs if sampled)
        assert all(lp == 0.0 for lp, m in zip(logprobs, mask) if not m)
        stream = list(group_prompt) + tokens[: len(tokens) - len(runs[-1][1])]
        conversation = _conversation(env.reset_text, env.actions[:2], system="Be brief.")
        expected = render_chat(fmt.chat_template, conversation, **dict(fmt.special_tokens))
        assert stream == tok.encode(expected)
    assert made[1].reset_text == "" and _turns(fin.tokens[1], fin.masks[1])[0][1] == chat.generation_ids
    runner.close()


RESETS = ("Round one.", "", "Round three: a harder one.")
_MADE: dict[str, int] = {}


def scripted(cfg):
    """``env.kind`` factory: the members of a group reset to ``RESETS`` in turn."""

    def make(task):
        j = _MADE.get(task.prompt_id, 0)
        _MADE[task.prompt_id] = j + 1
        return Scripted(RESETS[j % len(RESETS)])

    return make


@needs_smollm2
def test_the_generator_stage_emits_chat_episodes_whose_prompt_lost_its_generation_prompt(redis_url):
    """The generator stage (feeder, streamer, a real Redis-compatible server) with SmolLM2 on the
    code task: each group's ``prompt_ids`` are the task's prompt without its generation
    prompt, and each completion after them is its own conversation's rendering (its reset
    turn, the model's turns, the user and tool observations), observations masked."""
    _MADE.clear()
    cfg = RunConfig().with_overrides({
        "run_id": "chatep", "model.base_dir": str(SMOLLM2), "task.kind": "code", "task.max_new_tokens": 192,
        "generator.swap": "step", "generator.group_size": 3, "generator.prompts_per_batch": 1,
        "generator.temperature": 0.0, "feeder.max_prompts": 1, "redis.claim_idle_ms": 0, "redis.block_ms": 50,
        "env.kind": f"{Path(__file__).resolve()}:scripted", "env.max_turns": 3})
    tok = load_tokenizer(SMOLLM2)
    fmt = checkpoint_format(SMOLLM2)
    chat = ChatTurns.of(fmt, tok)
    r = connect(redis_url, name="t")
    keys = Keys("chatep", shards=cfg.redis.shards)
    run_feeder(cfg, r, keys, RecordingLog(), tokenizer=tok, max_rounds=1)
    Streamer(Generator(cfg, r, keys, "gen-a", RecordingLog())).run(max_batches=1)
    (g,) = [RolloutGroup.decode(f[b"d"]) for key in keys.stream_keys("rollouts") for _, f in r.xrange(key)]
    prompt = list(g.prompt_ids)
    assert tok.encode(g.prompt) == prompt + chat.generation_ids
    user = g.prompt.split("<|im_start|>user\n", 1)[1].rsplit("<|im_end|>\n<|im_start|>assistant\n", 1)[0]
    answers = [("user", "Too low. Try again."), ("tool", "result = 42")]
    observations = 0
    for j, (ids, mask, lp) in enumerate(zip(g.split(g.completion_ids), g.split(g.loss_mask),
                                          g.split(g.behaviour_logprobs))):
        runs = _turns(ids.tolist(), mask.tolist())
        assert (lp[mask == 0] == 0).all() and (lp[mask == 1] <= 0).all()
        assert runs[0][0] is False and all(s for s, _ in runs[1::2]) and not any(s for s, _ in runs[2::2])
        messages = [{"role": "user", "content": user}]
        if RESETS[j]:
            messages.append({"role": "user", "content": RESETS[j]})
        for (_, turn), (role, text) in zip(runs[1::2], answers[: len(runs[2::2])]):
            messages += [{"role": "assistant", "content": tok.decode(turn)}, {"role": role, "content": text}]
        observed = sum(len(t) for _, t in runs[: 1 + 2 * len(runs[2::2])])  # through the last observation
        assert prompt + ids.tolist()[:observed] == tok.encode(render_chat(fmt.chat_template, messages,
                                                                          **dict(fmt.special_tokens)))
        assert int(g.turns[j]) == len(runs[1::2])
        observations = max(observations, len(runs[2::2]))
    assert observations == 2, "no episode reached its tool observation"
    r.close()


def test_a_model_without_a_chat_template_keeps_the_raw_observations():
    """The plain format (the arithmetic task, ``task.chat_template: off``, a checkpoint with
    no template) has no chat turns: the runner appends each observation's raw encoding and the
    reset text right after the task's prompt."""
    tok = CharTokenizer()
    assert ChatTurns.of(PLAIN, tok) is None

    class Raw:
        def reset(self):
            return "7"

        def step(self, action):
            return Step(observation="12", tool_call=True)

        def close(self):
            pass

    runner = EpisodeRunner(lambda task: Raw(), EnvConfig(), tok, RecordingLog())
    prompt = np.array(tok.encode(" 1+2="), np.int32)
    task = PromptTask(prompt_id="p", prompt=" 1+2=", prompt_ids=prompt, reference="3", issued_at=0.0)
    assert runner.start("k", task, 2) == [tok.encode("7")] * 2
    assert runner.prompt("k", task.prompt_ids) is task.prompt_ids
    runner.submit("k", 0, "3")
    while runner.waiting:
        got = runner.collect(1.0)
    assert got == [("k", 0, encode_text(tok, "12"), False)]
    runner.finish("k", 2)
    runner.close()


@needs_smollm2
def test_chat_turns_of_the_smollm2_template_and_off():
    tok = load_tokenizer(SMOLLM2)
    assert ChatTurns.of(checkpoint_format(SMOLLM2, use="off"), tok) is None
    chat = ChatTurns.of(checkpoint_format(SMOLLM2), tok)
    assert chat.generation == "<|im_start|>assistant\n"
    assert chat.wrap("user") == ("\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
    assert chat.wrap("tool") == ("\n<|im_start|>tool\n", "<|im_end|>\n<|im_start|>assistant\n")
    assert chat.reset_wrap == ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
    assert Step(observation="x", tool_call=True).turn_role == "tool" and Step(observation="x").turn_role == "user"
    assert Step(observation="x", tool_call=True, role="user").turn_role == "user"
    prompt = np.array(tok.encode("no generation prompt"), np.int32)
    with pytest.raises(ChatTemplateError, match="task.chat_template"):
        chat.first(prompt, ["a reset"])
    assert chat.first(prompt, ["", ""]) == (prompt, [[], []])  # no reset text: the prompt as it is
    # In the generator such a prompt ends its group's episodes at their first turn, counted.
    runner = EpisodeRunner(lambda task: Scripted("a reset"), EnvConfig(), tok, RecordingLog(), chat=chat)
    task = PromptTask(prompt_id="p", prompt="no generation prompt", prompt_ids=prompt, reference="", issued_at=0.0)
    assert runner.start("k", task, 2) == [[], []] and runner.prompt("k", prompt) is prompt
    assert runner.take_counters()["env_errors_total"] == 2
    runner.submit("k", 0, "42")
    ((key, member, _, done),) = runner.collect(1.0)
    assert (key, member, done) == ("k", 0, True)
    runner.finish("k", 2)
    runner.close()


@needs_smollm2
def test_a_template_that_is_not_prefix_stable_is_refused_naming_the_field():
    """A template that writes the number of messages at the top renders a longer conversation
    as something other than the shorter one's continuation: refused, naming task.chat_template."""
    tok = load_tokenizer(SMOLLM2)
    base = checkpoint_format(SMOLLM2)
    counting = "{{ messages|length }}" + base.chat_template
    with pytest.raises(ChatTemplateError, match="task.chat_template.*prefix-stable"):
        ChatTurns(PromptFormat(chat_template=counting, special_tokens=base.special_tokens), tok)
    no_eos = base.chat_template.replace("'<|im_end|>' + '\n'", "'<|endoftext|>' + '\n'")
    assert no_eos != base.chat_template
    with pytest.raises(ChatTemplateError, match="task.chat_template"):
        ChatTurns(PromptFormat(chat_template=no_eos, special_tokens=base.special_tokens), tok)
