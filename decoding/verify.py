"""Layer 2: verification of k drafted tokens against the target's k+1 next-token distributions.

Both verifiers return (accepted, new_tokens): `accepted` drafted tokens are kept and one more token
comes from the target (its own next token, a residual sample, or the bonus token), so a step always
yields accepted + 1 tokens.
"""
from __future__ import annotations

import numpy as np
import torch

from .sampling import sample


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Longest prefix of `draft_tokens` (k,) equal to the target's argmax, plus the target's next token.

    `target_logits` is (k+1, V): row i is the target's prediction after the context and i drafted tokens.
    """
    target_tokens = target_logits.argmax(dim=-1)
    k = draft_tokens.shape[0]
    accepted = int((draft_tokens == target_tokens[:k]).int().cumprod(dim=0).sum()) if k else 0
    return accepted, torch.cat([draft_tokens[:accepted], target_tokens[accepted : accepted + 1]])


def verify_greedy_rows(draft_tokens: torch.Tensor, target_logits) -> tuple[list[int], list[list[int]], torch.Tensor]:
    """`verify_greedy` for every row at once, with one device-to-host transfer: (accepted per row, the
    tokens each row keeps as host lists, the target's argmax (rows, k+1) on the device, a numpy array on the CPU).

    A kept draft token equals the target's argmax at its position, so a row's kept tokens are the first
    accepted + 1 entries of the argmax row. Shapes: draft_tokens (rows, k), target_logits (rows, k+1, V), or a
    host (numpy) array of the target's argmax (rows, k+1) already taken (decoding/llama_cpp.py reads it off
    llama.cpp's buffer). On the CPU numpy's argmax does it (3 us against torch's 76 us over a 49,152-token
    vocabulary here); the same first-maximum rule."""
    if isinstance(target_logits, np.ndarray):
        return _greedy_rows_host(draft_tokens, target_logits)
    if target_logits.device.type == "cpu" and target_logits.dtype in (torch.float32, torch.float64, torch.float16):
        return _greedy_rows_host(draft_tokens, target_logits.numpy().argmax(axis=-1))
    target_tokens = target_logits.argmax(dim=-1)
    k = draft_tokens.shape[1]
    if k:
        accepted = (draft_tokens == target_tokens[:, :k]).int().cumprod(dim=1).sum(dim=1)
    else:
        accepted = torch.zeros(draft_tokens.shape[0], dtype=torch.long, device=target_tokens.device)
    packed = torch.cat([accepted[:, None].to(target_tokens.dtype), target_tokens], dim=1).tolist()  # the one sync
    return [row[0] for row in packed], [row[1 : row[0] + 2] for row in packed], target_tokens


def _greedy_rows_host(draft: torch.Tensor, target: np.ndarray) -> tuple[list[int], list[list[int]], np.ndarray]:
    """`verify_greedy_rows` on the host: draft (rows, k) on the CPU, the target's argmax (rows, k+1) a numpy array,
    returned as it is (a plain step, k = 0, makes no torch call)."""
    packed = target.tolist()
    k = draft.shape[1]
    if k:
        accepted = np.cumprod(draft.numpy() == target[:, :k], axis=1).sum(axis=1).tolist()
    else:
        accepted = [0] * len(packed)
    return accepted, [row[: a + 1] for row, a in zip(packed, accepted)], target


def verify_sampling(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, torch.Tensor]:
    """Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

    Drafted token x_i ~ q_i is kept with probability min(1, p_i(x_i) / q_i(x_i)); at the first
    rejection a token is drawn from the residual max(0, p_i - q_i) (normalised) and the step ends; if
    all k are kept, a bonus token is drawn from p_k. The output is distributed exactly as the
    target's own sampling. Shapes: draft_tokens (k,), draft_probs (k, V), target_probs (k+1, V).
    """
    k = draft_tokens.shape[0]
    if k:
        idx = torch.arange(k, device=draft_tokens.device)
        p = target_probs[idx, draft_tokens]
        q = draft_probs[idx, draft_tokens]
        u = torch.rand(k, generator=generator, device=draft_tokens.device)
        keep = u * q < p
        accepted = int(keep.int().cumprod(dim=0).sum())
    else:
        accepted = 0
    if accepted < k:
        residual = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0.0)
        total = residual.sum()
        # p == q exactly leaves no residual mass; then p itself is the right distribution
        last = sample(residual / total if total > 0 else target_probs[accepted], generator)
    else:
        last = sample(target_probs[k], generator)
    return accepted, torch.cat([draft_tokens[:accepted], last.reshape(1)])
