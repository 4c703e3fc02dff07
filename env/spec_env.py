"""SpecDecodeEnv: the real draft-verify loop as a Gymnasium env.

`reset()` picks a prompt with `np_random`, prefills, and returns the observation of the one
observation builder (`decoding.observation`); `step(action)` runs exactly one `speculative_step` with
k = action. The reward is measured against plain decoding on this device at the step's context
length (see `env.episode.step_reward`): by default the plain steps the step saved; with
reward="speedup" the step's speedup (tokens / seconds / plain tokens per second). With `batch_sizes`,
each episode draws a batch size and that many prompts and decodes them together; a step is credited
with the plain decoding time it removed from the batch (`env.episode.PlainCredit`: the batch ends
with its last row, so advancing the row furthest behind is what saves time), in plain steps of the
episode's batch.

With `loads` (env/load.py: none, compute, memory, both), each episode draws a background load and runs beside
it, the load started when the episode starts and stopped when the next one changes it, at `close()`, and with
the process if it is killed; plain decoding is priced by the plain speed measured under that load
(`plain_speeds`), so the reward stays the time saved against plain decoding on the same busy machine.
"""
from __future__ import annotations

import gymnasium as gym
import numpy as np

from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.loop import speculative_step, start
from specpilot.decoding.models import load_draft, load_target
from specpilot.decoding.observation import ObservationBuilder
from specpilot.decoding.policies import DEFAULT_K_MAX, ActionTable
from specpilot.decoding.prompts import Prompt, load_prompts
from specpilot.decoding.sampling import Sampling

from .episode import EpisodeStats, PlainCredit, step_reward
from .load import LOADS, start_load, stop_load
from .plain_speed import PlainSpeed, measure_plain_speed


class SpecDecodeEnv(gym.Env):
    metadata = {"render_modes": []}

    def __init__(
        self,
        target=None,
        draft=None,
        prompts: list[Prompt] | None = None,
        k_max: int = DEFAULT_K_MAX,
        max_new_tokens: int = 64,
        chat: bool = True,
        sampling: Sampling = Sampling(),
        plain_speed: PlainSpeed | None = None,
        observer: ObservationBuilder | None = None,
        encoded: list[list[int]] | None = None,
        reward: str = "saved",
        batch_sizes: tuple[int, ...] | list[int] = (1,),
        loads: tuple[str, ...] | list[str] = ("none",),
        plain_speeds: dict[str, PlainSpeed] | None = None,
        stop_levels=(0.0,),
        sources=(None,),
    ):
        super().__init__()
        if target is None:  # gym.make with no arguments: the embedded pair
            target = load_target("embedded")
            draft = load_draft("ngram", target)
        if draft is None:
            raise SpecPilotError("SpecDecodeEnv needs a draft")
        self.target, self.draft = target, draft
        self.prompts = prompts if prompts is not None else load_prompts(split="train")
        self.k_max, self.max_new_tokens, self.sampling, self.reward = k_max, max_new_tokens, sampling, reward
        # token ids of the prompts (given, or encoded here with the target's tokenizer)
        self._encoded = encoded if encoded is not None else [target.encode(p.text, chat=chat) for p in self.prompts]
        self.batch_sizes = [int(b) for b in batch_sizes]
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise SpecPilotError(f"batch sizes must be >= 1, got {batch_sizes}")
        self.loads = list(loads)
        if not self.loads or any(x not in LOADS for x in self.loads):
            raise SpecPilotError(f"background loads are ones of {', '.join(LOADS)}, got {loads}")
        self.plain_speeds = dict(plain_speeds or {})
        if plain_speed is not None and "none" in self.loads:  # `plain_speed`: measured without a load
            self.plain_speeds.setdefault("none", plain_speed)
        for load in self.loads:  # plain decoding's speed under each load, measured beside it
            if load not in self.plain_speeds:
                procs = start_load(load)
                try:
                    self.plain_speeds[load] = measure_plain_speed(target, self._encoded[0], batch_sizes=self.batch_sizes)
                finally:
                    stop_load(procs)
        self.load, self._load_procs = self.loads[0], []
        self.plain_speed = self.plain_speeds[self.load]
        self.observer = observer or ObservationBuilder(k_max)
        self.credit = PlainCredit(lambda context, rows: self.plain_speed.step_seconds(context, rows))
        # an action is k, or with several stop levels (k, the top-1 probability below which the draft stops)
        # ... and for a drafter with several sources (the hybrid's) with `sources`, (source, k, stop level) triples
        self.actions = ActionTable(k_max, stop_levels, sources)
        self.action_space = gym.spaces.Discrete(len(self.actions))
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, shape=(len(self.observer.names),), dtype=np.float32)
        self.state = None
        self.stop = None
        """The stop rule inside the draft for the next step (a `decoding.drafters.StopRule`; None: draft all k)."""
        self.source: str | None = None
        """The draft source of the next step for a hybrid drafter, unless the action names one (None: its default)."""
        self.prompt: Prompt | None = None

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        options = options or {}
        if len(self.batch_sizes) == 1 and self.batch_sizes[0] == 1 or "prompt_index" in options:
            index = int(options["prompt_index"]) if "prompt_index" in options else int(self.np_random.integers(len(self.prompts)))
            indices = [index]
            prompt_ids = self._encoded[index]
        else:  # a batch: a batch size for the episode, then that many prompts
            batch = int(options.get("batch_size", 0)) or int(self.np_random.choice(self.batch_sizes))
            indices = [int(i) for i in self.np_random.integers(len(self.prompts), size=batch)]
            prompt_ids = [self._encoded[i] for i in indices]
        self.prompt = self.prompts[indices[0]]
        self._switch_load(str(options.get("load") or (self.loads[0] if len(self.loads) == 1
                                                       else self.np_random.choice(self.loads))))
        self.state = start(self.target, self.draft, prompt_ids, self.max_new_tokens, self.sampling,
                           seed=int(self.np_random.integers(2**31)))
        self.observer.reset(self.state)
        self.episode = EpisodeStats()
        self.credit.reset(self.state)
        return self.observer.build(self.state), {"question_id": self.prompt.question_id, "category": self.prompt.category,
                                                 "batch_size": len(indices), "load": self.load}

    def _switch_load(self, load: str) -> None:
        """Run the coming episode beside `load`: the running load is stopped when it changes."""
        if load not in self.plain_speeds:
            raise SpecPilotError(f"unknown background load '{load}'; this env has {', '.join(self.loads)}")
        if load != self.load or (load != "none" and not self._load_procs):
            stop_load(self._load_procs)
            self._load_procs = start_load(load)
        self.load, self.plain_speed = load, self.plain_speeds[load]

    def close(self) -> None:
        stop_load(self._load_procs)
        self._load_procs = []
        super().close()

    def step(self, action):
        if self.state is None or self.state.done:
            raise SpecPilotError("call reset() before step() (the episode has ended)")
        k, stop = self.actions.decode(action, self.stop)
        step = speculative_step(self.state, k, stop=stop, source=self.actions.source(action, self.source))
        self.observer.push(step)
        tokens, batch = len(step.new_tokens), step.batch_size
        seconds = max(step.seconds, 1e-9)
        saved = self.credit.take(self.state)  # plain decoding time this step removed
        reward = step_reward(saved / self.credit.unit, seconds, self.credit.unit, self.reward)
        self.episode.add(tokens, seconds, saved, step.k * batch, sum(step.accepted_rows))
        terminated = self.state.done
        if terminated:  # the rows' true lengths are known now (a row may have ended early with EOS)
            self.episode.plain_seconds = self.credit.batch_seconds([len(r.generated) for r in self.state.rows])
        info = {"k": step.k, "accepted": step.accepted, "tokens": tokens, "seconds": seconds,
                "tokens_per_s": tokens / seconds, "batch_size": batch}
        if terminated:
            info["spec_episode"] = self.episode.summary(self.prompt.category)
        return self.observer.build(self.state), float(reward), terminated, False, info
