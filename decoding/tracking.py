"""W&B experiment tracking shared by the PPO trainer and the draft distiller."""
from __future__ import annotations

import os
from pathlib import Path


def start_tracking(track: bool, project: str, run_dir: Path, config: dict, resume_id: str | None = None):
    """A W&B run: online with WANDB_API_KEY, offline otherwise (sync later with `wandb sync`); None when off."""
    if not track:
        return None
    import wandb  # takes seconds to import: only when tracking is on

    mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    return wandb.init(project=project, dir=str(run_dir), config=config, sync_tensorboard=True, mode=mode,
                      id=resume_id, resume="allow" if resume_id else None, reinit="finish_previous")
