"""Gymnasium environments over the specpilot decoding loop."""
import gymnasium as gym

from .plain_speed import PlainSpeed, measure_plain_speed
from .replay_env import ReplayEnv
from .spec_env import SpecDecodeEnv

ENV_ID = "specpilot/SpecDecode-v0"
REPLAY_ENV_ID = "specpilot/SpecDecodeReplay-v0"

if ENV_ID not in gym.registry:
    # nondeterministic: the reward is wall-clock speed and the observation holds live hardware counters
    gym.register(id=ENV_ID, entry_point="specpilot.env.spec_env:SpecDecodeEnv", nondeterministic=True)

if REPLAY_ENV_ID not in gym.registry:
    gym.register(id=REPLAY_ENV_ID, entry_point="specpilot.env.replay_env:ReplayEnv")

__all__ = ["ENV_ID", "REPLAY_ENV_ID", "PlainSpeed", "ReplayEnv", "SpecDecodeEnv", "measure_plain_speed"]
