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


def log_rows(track: bool, project: str, run_dir: Path, config: dict, prefix: str, rows: list[dict] = (),
             summary: dict | None = None) -> None:
    """One W&B run for a job without a training loop of its own (the rollout warm start, an evaluation): each
    row logged as a step under `prefix/`, then the summary; nothing when tracking is off."""
    run = start_tracking(track, project, run_dir, config)
    if run is None:
        return
    try:
        for row in rows:
            run.log({f"{prefix}/{key}": value for key, value in row.items()})
        run.summary.update({f"{prefix}/{key}": value for key, value in (summary or {}).items()})
    finally:
        run.finish()
