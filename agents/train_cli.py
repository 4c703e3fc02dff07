"""The main job: `python scripts/train_policy.py --device cpu` trains, exports and evaluates a policy."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from specpilot.decoding.config import parse_config
from specpilot.decoding.learned import LearnedK

from .train_phases import plain_speed_phase, plan_phases, train_members
from .train_prepare import draft_phase, load_replay_data, resolve_run
from .train_select import defer_phase, evaluate_phase


@dataclass
class TrainConfig:
    """Train a PPO draft-length policy for this device on the real decode loop, export and evaluate it."""

    device: str = "auto"
    """Device: auto | cpu | cuda[:N] | a device key such as h100 (the first visible GPU of that kind; must be present)."""
    timesteps: int = 0
    """PPO env steps of the run, and nothing else: split over its PPO phases (replay warm-up, replay, real loop) in
    the proportions of agents/hyperparams.yaml (all to the last where the YAML gives none); 0 = the YAML's own steps. The rule
    tuning and the warm start are not PPO steps (see --quick). The run prints its plan first and never runs more
    PPO steps than asked."""
    quick: bool = False
    """A quick try of the whole chain in about a minute: one seed, batch sizes 1-2, one short warm-start round,
    rules tuned on a few traces, short PPO phases (the real loop's without a load), two test prompts; written under
    runs/quick (or --out), never over a policy. A device or pair without its cost profile and traces measures them
    first (--env auto): minutes more."""
    replay_timesteps: int = -1
    """Steps of the replay phase, taken out of --timesteps (-1 = its share of it, or the YAML's)."""
    warmup_timesteps: int = -1
    """Steps of the replay warm-up phase, taken out of --timesteps (-1 = its share, or the YAML's)."""
    target: str = "embedded"
    """Target model: 'embedded' (SmolLM2-135M-Instruct, offline), a hub id, a folder or a .gguf file."""
    draft: str = "ngram"
    """Drafter: ngram | ngram:N | default (the trained head) | hybrid | self:bf16 | MODEL_ID_OR_PATH | auto (first the
    draft whose tuned rule is fastest on held-out train prompts here, agents/pair_select.py, recorded for
    generate.py --draft auto; then that draft's policy)."""
    env: str = "auto"
    """real | replay | both (pre-train on the replay env, fine-tune on the real loop) | auto (both, after measuring
    here the cost profile and the train split's traces this device and (target, draft) pair lack: `prepare_phase`)."""
    profile: str | None = None
    """Cost profile for the replay env (default: profiles/DEVICE.json, from scripts/profile_device.py)."""
    traces: str | None = None
    """Acceptance traces for the replay env (default: profiles/traces-DRAFT.json)."""
    prompts: str | None = None
    """Prompt JSONL (default: the project's set); its train split trains, its test split evaluates."""
    track: bool = True
    """Track the run with W&B (online with WANDB_API_KEY, else offline; sync later with `wandb sync`)."""
    wandb_project: str = "specpilot"
    """W&B project name."""
    seed: int | None = None
    """Seed of the warm start, of PPO and of the env's prompt choice: one policy (default: the YAML's `seeds`)."""
    seeds: str = ""
    """Comma-separated seeds: one policy per seed (OUT/DEVICE/DRAFT/seeds/seed-N/), merged into one whose logits
    are their mean (agents/ensemble.py); default: the YAML's `seeds` (CPU: 2,1, the committed policy's recipe), else 0."""
    resume: bool = False
    """Continue a killed run from its last checkpoint in OUT/DEVICE/run/checkpoints."""
    out: str = ""
    """Root folder: the policy goes to OUT/DEVICE/DRAFT/policy.{json,safetensors}, the run to OUT/DEVICE/DRAFT/run/
    (default: policies/ in the working directory when it has one, as a source checkout does, else the user folder
    $SPECPILOT_HOME/policies or ~/.local/share/specpilot/policies)."""
    batch_sizes: str = ""
    """Comma-separated batch sizes episodes draw from, e.g. 1,2,4,8,16 (default: the YAML's batch_sizes)."""
    hp: list[str] = field(default_factory=list)
    """Hyperparameter override KEY=VALUE (repeatable), e.g. --hp n_steps=128."""
    eval_per_category: int = 1
    """Held-out (test split) prompts per category for the final evaluation (0 = skip it)."""
    eval_max_new_tokens: int = 48
    """Tokens per prompt in the final evaluation."""
    eval_repeats: int = 3
    """Paired repeats of the final evaluation (policies interleaved; learned / best-rule gets a t interval)."""
    dtype: str = "auto"
    """Model dtype: auto (fp32 on CPU, bf16 on GPU) | float32 | bfloat16 | float16."""
    progress: bool = True
    """Show progress bars."""
    allow_simulated: bool = False
    """Train for a chip from a simulated cost profile (--profile PATH from profile_device.py --simulate): replay
    env only, no GPU needed, the device need not be present; the exported policy records it."""
    condition_profiles: str | None = None
    """Comma-separated cost profiles of the same device under other machine conditions (a power cap, a
    co-tenant, a background load: profile_device.py --simulate D --condition C, or --background-load L), each
    with the counters as read under it: replay episodes draw the condition (the --profile one included), so
    the counters carry what the policy needs to know about the machine. Default: the YAML's `condition_loads`,
    the profiles profile_device.py --background-load L wrote for this device and draft (profiles/load/); '' = none."""
    hardware_noise: float = 0.02
    """With --condition-profiles: each replay episode reads every counter off by this standard deviation."""
    background_load: str | None = None
    """Comma-separated background loads the real-loop env draws from per episode (env/load.py: none | compute
    | memory | both), started and stopped by the env (never left running, not even when the run is killed);
    the reward prices plain decoding by its speed measured under the same load. Default: the YAML's
    `background_loads` (CPU: none,compute,memory)."""
    profiles_out: str = ""
    """Where --env auto writes a cost profile or traces this device and pair lack (default: profiles/ in the working
    directory when it has one, else the user folder, where later runs find them)."""
    n_envs: int = 1
    """Envs PPO steps at once: replay envs in N processes (one core each); real-loop envs one per visible GPU
    (each process loads the target on its GPU), or on the CPU N envs sharing this process's model."""


def train_main(argv: list[str] | None = None) -> int:
    cfg = parse_config(TrainConfig, argv) if not isinstance(argv, TrainConfig) else argv
    started = time.perf_counter()
    draft_phase(cfg)
    run = resolve_run(cfg)
    if run.mode in ("replay", "both"):
        run.replay = load_replay_data(run)
    plain_speed = plain_speed_phase(run)
    phases, warm = plan_phases(run, plain_speed)
    meta_path, how = train_members(run, phases, warm)
    defer_phase(run, meta_path)
    learned = LearnedK.load(meta_path, device=run.device_key, draft=run.draft.name, replay=run.simulated is not None,
                            target=run.target.name if run.simulated is None else None)
    print(f"specpilot: exported {meta_path} ({how}); one decision takes "
          f"{1e6 * learned.decision_seconds():.1f} us", file=sys.stderr)
    if run.test_prompts:
        evaluate_phase(run, learned)
    print(f"specpilot: done in {time.perf_counter() - started:.0f} s"
          + (f" (evaluation: {run.run_dir / 'eval.json'})" if run.test_prompts else ""), file=sys.stderr)
    return 0
