"""Draft distillation: train the default draft head for a target (scripts/distill_draft.py)."""
