"""A trained draft head for a given target (EAGLE / ReDrafter style, FR-Spec reduced vocabulary).

The head reads the target's last-layer hidden state h at the last position the target has processed
and the embedding of the token after it, and predicts the target's next hidden state; chaining
that k times drafts k tokens. It owns no embedding and no LM head: it reuses the target's embedding
and the rows of the target's LM head for a frequent-token sub-vocabulary (FR-Spec), which makes a
drafted token cost a few MB of weight reads instead of the target's whole 49k-row head. Because the
target's hidden state already summarises the whole context, the head needs no KV cache: its state is
one vector, so rollback is free and batching is trivial.

Files (a folder): `draft_head.json` (shape, sub-vocabulary, the target it was trained for) and
`draft_head.safetensors` (the head's own weights, a few MB).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from .drafters import Draft, empty_draft, row_entropies
from .errors import SpecPilotError
from .paths import find_artifact
from .sampling import Sampling, probs_from_logits, sample
from .synth_prompts import is_synthetic

FORMAT = "specpilot-draft-head/1"
CONFIG_FILE = "draft_head.json"
WEIGHTS_FILE = "draft_head.safetensors"
DEFAULT_DRAFT = "drafts/smollm2-135m-head"
"""The default draft head, as a path below an artifact root (`specpilot.decoding.paths.find_artifact`)."""


@dataclass
class HeadConfig:
    hidden_size: int
    intermediate_size: int
    blocks: int
    vocab_ids: list[int]
    """Target token ids the head can propose (the sub-vocabulary), most frequent first."""
    target_vocab_size: int
    target_signature: list[float] = field(default_factory=list)
    """Mean |weight| of the target's first embedding rows: catches a head loaded on another target."""
    target_name: str = ""
    eps: float = 1e-5
    feature_layers: list[int] = field(default_factory=lambda: [-1])
    """Indices into the target's `hidden_states` tuple the head reads at its first step (EAGLE-3's low, middle
    and high features; [-1]: the last layer only, after the final norm)."""
    trained: dict = field(default_factory=dict)
    """How it was trained (data, steps, final metrics, `prompt_ids`: the prompts whose answers it learned from)."""

    def distilled_on(self, question_id: str, category: str) -> bool:
        """Whether this head learned from the prompt: its answer was in the distillation data, or the prompt comes
        from the synthetic generator the distillation drew its prompts from. A policy or rule for this head is
        tuned on the other prompts: acceptance on these flatters the head (`python -m specpilot.bench.draft_seen_cli`
        measures by how much)."""
        if question_id in set(self.trained.get("prompt_ids") or ()):
            return True
        return int((self.trained.get("config") or {}).get("synthetic_prompts") or 0) > 0 and is_synthetic(question_id, category)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class MLPBlock(nn.Module):
    """Pre-norm residual SwiGLU block."""

    def __init__(self, hidden: int, inner: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        self.gate = nn.Linear(hidden, inner, bias=False)
        self.up = nn.Linear(hidden, inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        y = self.norm(x)
        return x + self.down(nn.functional.silu(self.gate(y)) * self.up(y))


class DraftHead(nn.Module):
    """g_{i} = blocks(fc([norm(g_{i-1}); norm(e(x_i))])), logits_i = W_sub @ norm(g_i).

    g_0 is the target's final hidden state (after its last norm), or with several `feature_layers` a learned
    mix of those layers' states, each normed (`start`); g_i is trained to match the target's final hidden state.
    """

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg
        self.norm_state = RMSNorm(h, cfg.eps)
        self.norm_embed = RMSNorm(h, cfg.eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.blocks = nn.ModuleList(MLPBlock(h, cfg.intermediate_size, cfg.eps) for _ in range(cfg.blocks))
        self.norm_out = RMSNorm(h, cfg.eps)
        layers = len(cfg.feature_layers)
        self.norm_features = nn.ModuleList(RMSNorm(h, cfg.eps) for _ in range(layers)) if layers > 1 else None
        self.fuse = nn.Linear(layers * h, h, bias=False) if layers > 1 else None

    def start(self, features: torch.Tensor) -> torch.Tensor:
        """g_0 from the target's hidden states at the last processed position (`feature_layers`, concatenated)."""
        if self.fuse is None:
            return features
        parts = features.split(self.cfg.hidden_size, dim=-1)
        return self.fuse(torch.cat([norm(part) for norm, part in zip(self.norm_features, parts)], dim=-1))

    def advance(self, state: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        x = self.fc(torch.cat([self.norm_state(state), self.norm_embed(embedded)], dim=-1))
        for block in self.blocks:
            x = block(x)
        return x

    def logits(self, state: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        """Logits over the sub-vocabulary (head_weight: the target's LM-head rows of vocab_ids)."""
        return self.norm_out(state) @ head_weight.T


def target_signature(model, rows: int = 8) -> list[float]:
    weight = model.get_input_embeddings().weight
    return [round(float(v), 6) for v in weight[:rows].detach().float().abs().mean(dim=1)]


def sub_head_weight(model, vocab_ids: torch.Tensor) -> torch.Tensor:
    return model.get_output_embeddings().weight.detach()[vocab_ids].contiguous()


def save_head(head: DraftHead, folder: str | Path) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().float().contiguous().cpu() for name, t in head.state_dict().items()}
    save_file(state, str(folder / WEIGHTS_FILE))
    (folder / CONFIG_FILE).write_text(json.dumps({"format": FORMAT, **asdict(head.cfg)}, indent=1) + "\n")
    return folder


def load_head_config(folder: str | Path) -> HeadConfig:
    """A head's config (shape, sub-vocabulary, how it was trained) from its folder, without the weights."""
    folder = Path(folder)
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise SpecPilotError(f"no draft head in {folder} (expected {CONFIG_FILE} and {WEIGHTS_FILE}); "
                             "build one with scripts/distill_draft.py")
    try:
        raw = json.loads(config_path.read_text())
        if raw.pop("format", None) != FORMAT:
            raise ValueError(f"not a {FORMAT} file")
        return HeadConfig(**raw)
    except (ValueError, TypeError) as exc:
        raise SpecPilotError(f"corrupt draft head config {config_path}: {exc}") from None


def load_head(folder: str | Path) -> DraftHead:
    """A head from its folder; clear errors for a missing or corrupt file."""
    folder = Path(folder)
    weights_path = folder / WEIGHTS_FILE
    head = DraftHead(load_head_config(folder))
    try:
        state = load_file(str(weights_path))
        head.load_state_dict(state)
    except (SafetensorError, RuntimeError, OSError) as exc:
        raise SpecPilotError(f"corrupt draft head weights {weights_path}: {str(exc).splitlines()[0]}") from None
    head.weights_id = hashlib.sha256(weights_path.read_bytes()).hexdigest()[:16]
    return head.eval()


def is_head_folder(spec: str) -> bool:
    return (Path(spec).expanduser() / CONFIG_FILE).is_file()


def head_config_of(draft_name: str) -> HeadConfig | None:
    """The config of the head a draft name loads (`default`, `head`, `hybrid`, whose head is the default one, or a
    head's folder); None for any other draft."""
    if draft_name in ("default", "head", "hybrid"):
        return load_head_config(default_draft_folder())
    return load_head_config(draft_name) if is_head_folder(draft_name) else None


def default_draft_folder() -> Path:
    """The default head's folder in the first lookup root that holds it (working directory, user folder, package)."""
    folder = find_artifact(Path(DEFAULT_DRAFT) / CONFIG_FILE).parent
    if (folder / CONFIG_FILE).is_file():
        return folder
    raise SpecPilotError(
        f"the default draft ({DEFAULT_DRAFT}) is missing; rebuild it with "
        "`python scripts/distill_draft.py` or pick another --draft (ngram, self:bf16, a model path)"
    )


class HeadDrafter:
    """Drafter protocol around a DraftHead bound to its target (embedding + LM-head rows)."""

    needs_hidden = True
    reports_confidence = True

    def __init__(self, head: DraftHead, target_model, name: str = "head", check: bool = True):
        cfg = head.cfg
        out = target_model.get_output_embeddings().weight
        if check:
            hidden = int(out.shape[1])
            if (int(out.shape[0]), hidden) != (cfg.target_vocab_size, cfg.hidden_size):
                raise SpecPilotError(
                    f"draft head '{name}' was trained for a target with vocab {cfg.target_vocab_size} and hidden size "
                    f"{cfg.hidden_size}; this target has vocab {out.shape[0]} and hidden size {hidden}")
            mine = target_signature(target_model, len(cfg.target_signature))
            if cfg.target_signature and any(abs(a - b) > 1e-2 * max(abs(b), 1e-6) for a, b in zip(mine, cfg.target_signature)):
                raise SpecPilotError(
                    f"draft head '{name}' was trained for another target ({cfg.target_name or 'unknown'}): "
                    "its embedding signature differs from this target's")
        self.name = name
        self.weights_id = getattr(head, "weights_id", "")
        """The first 16 hex digits of the weights file's sha256 ('' for a head built in memory): traces and cost
        profiles record it, so that ones made with other weights of the same name are not reused."""
        self.hidden_layers = tuple(cfg.feature_layers)
        self.distilled_on = cfg.distilled_on
        self.head = head.to(device=out.device, dtype=out.dtype).eval()
        self.embed = target_model.get_input_embeddings()
        self.vocab_ids = torch.tensor(cfg.vocab_ids, dtype=torch.long, device=out.device)
        self.head_weight = sub_head_weight(target_model, self.vocab_ids)
        self.vocab_size = int(out.shape[0])

    def reset(self, prompt: torch.Tensor) -> None:
        pass

    def rollback(self, length: int) -> None:
        pass

    def _full(self, p_sub: torch.Tensor) -> torch.Tensor:
        full = torch.zeros(*p_sub.shape[:-1], self.vocab_size, dtype=p_sub.dtype, device=p_sub.device)
        return full.index_copy_(-1, self.vocab_ids, p_sub)

    def reset_batch(self, contexts) -> None:
        pass

    def rollback_batch(self, lengths, rows) -> None:
        pass

    def propose(self, context, k, sampling: Sampling, generator, stop=None, target_hidden=None) -> Draft:
        if target_hidden is None or target_hidden.shape[0] == 0:
            return empty_draft(context.device)
        draft = self.propose_batch([context], k, sampling, generator, stop, target_hidden[-1:])
        draft.tokens = draft.tokens[0]
        draft.probs = draft.probs[0] if draft.probs is not None else None
        return draft

    @torch.inference_mode()
    def propose_batch(self, contexts, k, sampling: Sampling, generator, stop=None, target_hidden=None,
                      rows=None) -> Draft:
        """k tokens per row from the rows' last target hidden states (rows, hidden); stops early where the
        `stop` rule says every row would."""
        device = contexts[0].device
        if k <= 0 or target_hidden is None:
            return Draft(tokens=torch.empty(len(contexts), 0, dtype=torch.long, device=device))
        state = self.head.start(target_hidden)
        token = torch.stack([c[-1] for c in contexts])
        return self.draft_on(state, token, k, sampling, generator, stop, device)

    def draft_on(self, state, token: torch.Tensor, k: int, sampling: Sampling, generator, stop=None, device=None,
                 drafted: Draft | None = None) -> Draft:
        """Up to k head tokens from `state`, `token` (rows,) the last one fed; appended to `drafted` (tokens already
        proposed, with their probs, confidences and entropies: the hybrid's lookup tokens) where given."""
        tokens = list(drafted.tokens.unbind(1)) if drafted is not None else []
        probs = list(drafted.probs.unbind(1)) if drafted is not None and drafted.probs is not None else []
        confidences = list(drafted.confidences) if drafted is not None else []
        entropies = list(drafted.entropies) if drafted is not None else []
        for _ in range(k):
            state = self.head.advance(state, self.embed(token))
            p_sub = probs_from_logits(self.head.logits(state, self.head_weight), sampling)
            top, entropy = p_sub.max(dim=-1).values.tolist(), row_entropies(p_sub).tolist()
            if stop is not None and stop.stops(top, entropy):
                break
            index = p_sub.argmax(dim=-1) if sampling.greedy else sample(p_sub, generator)
            token = self.vocab_ids[index]
            tokens.append(token)
            confidences.append(sum(top) / len(top))
            entropies.append(sum(entropy) / len(entropy))
            if not sampling.greedy:
                probs.append(self._full(p_sub))
        if not tokens:
            return Draft(tokens=torch.empty(token.shape[0], 0, dtype=torch.long, device=device or token.device))
        return Draft(tokens=torch.stack(tokens, dim=1), probs=torch.stack(probs, dim=1) if probs else None,
                     confidences=confidences, entropies=entropies)
