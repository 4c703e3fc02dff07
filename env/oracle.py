"""Acceptance traces, the hindsight-optimal schedule (the oracle) and its replay policy.

With greedy decoding the output is fixed whatever k is, and the draft's proposal at position i
depends only on the prefix. One pass records, per position i of the target's output:
  m(i) = how many of the draft's next K tokens match the target's output,
  a(i) = how many tokens the draft can propose at all (a prompt-lookup draft may have fewer than K),
plus the draft-side features of the proposal (confidences, entropies, n-gram match length).
For any policy the step from i with k drafts k' = min(k, a(i)) tokens and accepts min(k', m(i)).
With a device cost model t(k', context) the minimum-time schedule is the dynamic program
  T(i) = min_k [ t(k', i) + T(i + min(k', m(i)) + 1) ],   T(n) = 0.

Sampled decoding with a deterministic draft (prompt lookup) replays exactly too. Its proposal is a point
mass q = 1 on token x, so rejection sampling keeps x with probability p(x) and otherwise draws from p with x
removed: the same law as drawing y ~ p and keeping x iff y == x. A speculative run is then a function of one
sampled continuation, the one plain sampling would give, and a trace of that continuation (`record_trace`
with a `Sampling`) yields m(i) and a(i) exactly as above; averaged over prompts (one draw each) it estimates the
expected time of any policy without bias. A model draft samples its proposals, so its traces stay greedy.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from specpilot.decoding.drafters import NgramDrafter, hidden_features
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.hardware import counters_by_name
from specpilot.decoding.head_draft import head_config_of
from specpilot.decoding.paths import atomic_write_text, read_json_file
from specpilot.decoding.loop import generate
from specpilot.decoding.policies import LengthPolicy, NoSpeculation
from specpilot.decoding.sampling import Sampling


@dataclass
class Trace:
    """Acceptance trace of one prompt: greedy, or one sampled continuation with a prompt-lookup draft."""

    question_id: str
    category: str
    prompt_ids: list[int]
    output_ids: list[int]
    matches: list[int]
    """m(i) for i = 0 .. len(output) - 1."""
    available: list[int]
    """a(i): tokens the draft proposes from position i (<= K)."""
    confidences: list[list[float]] = field(default_factory=list)
    entropies: list[list[float]] = field(default_factory=list)
    match_lens: list[int] = field(default_factory=list)
    k_max: int = 8
    ngram_n: int = 0
    """The n of the prompt-lookup draft that recorded it (`ngram:N`; 0: a model draft): the replay recomputes
    that drafter's match statistics from the tokens."""
    sources: dict[str, dict[str, list]] = field(default_factory=dict)
    """A hybrid drafter's trace (`--draft hybrid`): the fields above are its lookup's, and here each other source
    ('head', 'extend') has its own `matches`, `available`, `confidences` and `entropies` at every position
    (`env.sources.source_view`), so that a replay or the oracle prices any choice of source per step."""


@torch.inference_mode()
def record_trace(target, draft, prompt_ids: list[int], max_new_tokens: int, k_max: int,
                 question_id: str = "", category: str = "", sampling: Sampling = Sampling(), seed: int = 0) -> Trace:
    """Plain decoding of the prompt (greedy, or sampled with `sampling` and `seed`), then the draft's K-token
    proposal at every position. Sampled traces need a deterministic draft (prompt lookup; module docstring)."""
    if not sampling.greedy and not isinstance(draft, NgramDrafter):
        raise SpecPilotError(f"a sampled trace needs a prompt-lookup draft (ngram:N), got '{draft.name}': a model "
                             "draft samples its proposals, so one continuation does not fix its acceptance")
    output = generate(target, None, NoSpeculation(), prompt_ids, max_new_tokens, sampling, seed).token_ids
    full = torch.tensor(list(prompt_ids) + output, dtype=torch.long, device=target.device)
    n_prompt = len(prompt_ids)
    hidden = None
    if draft.needs_hidden:  # the target's last hidden states, as the loop would hand them over
        hidden = hidden_features(target.model(input_ids=full[None], output_hidden_states=True).hidden_states, draft)[0]
    hybrid = getattr(draft, "lookup", None) is not None and hasattr(draft, "head")  # decoding.hybrid.HybridDrafter
    draft.reset(full[:n_prompt])
    found = {source: proposals(draft, full, n_prompt, output, hidden, k_max, source if hybrid else None)
             for source in (("lookup", "head", "extend") if hybrid else (None,))}
    main = found.pop("lookup" if hybrid else None)
    return Trace(question_id, category, list(prompt_ids), output, main["matches"], main["available"],
                 main["confidences"], main["entropies"], main.pop("match_lens"), k_max,
                 ngram_n=draft.lookup.max_n if hybrid else draft.max_n if isinstance(draft, NgramDrafter) else 0,
                 sources={source: {key: value for key, value in rows.items() if key != "match_lens"}
                          for source, rows in found.items()})


def proposals(draft, full: torch.Tensor, n_prompt: int, output: list[int], hidden, k_max: int,
              source: str | None = None) -> dict[str, list]:
    """The draft's greedy K-token proposal at every position of `output` (from `source`, a hybrid's), checked
    against the output: {matches, available, confidences, entropies, match_lens}, one entry per position."""
    rows = {"matches": [], "available": [], "confidences": [], "entropies": [], "match_lens": []}
    greedy = Sampling()
    for i in range(len(output)):
        context = full[: n_prompt + i]
        at = context.shape[0] - 2  # the last position the target has processed before this step
        kwargs = {"source": source} if source else {}
        proposal = draft.propose(context, k_max, greedy, None,
                                 target_hidden=hidden[at : at + 1] if hidden is not None and at >= 0 else None, **kwargs)
        tokens = proposal.tokens.tolist()
        truth = output[i : i + k_max]
        m = 0
        while m < min(len(tokens), len(truth)) and tokens[m] == truth[m]:
            m += 1
        rows["matches"].append(m)
        rows["available"].append(len(tokens))
        rows["confidences"].append([round(c, 4) for c in proposal.confidences])
        rows["entropies"].append([round(e, 4) for e in proposal.entropies])
        rows["match_lens"].append(proposal.match_len)
        draft.rollback(n_prompt + i)
    return rows


def save_traces(traces: list[Trace], path: str | Path, meta: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(path), json.dumps({"meta": meta, "traces": [asdict(t) for t in traces]}))


def trace_temperature(meta: dict) -> float:
    """The sampling temperature the traces were recorded at (0: greedy; files from before it was recorded)."""
    return float(meta.get("temperature") or 0.0)


def load_traces(path: str | Path) -> tuple[list[Trace], dict]:
    data = read_json_file(path, "trace file", "record it with scripts/profile_device.py", keys=("traces",))
    try:
        traces = [Trace(**t) for t in data["traces"]]
        draft = str(data.get("meta", {}).get("draft", ""))
        for t in traces:  # files recorded before traces carried it: the n is in the draft's name
            if not t.ngram_n and draft.startswith("ngram:"):
                t.ngram_n = int(draft.split(":")[1])
        for t in traces:
            if not len(t.matches) == len(t.available) == len(t.output_ids):
                raise ValueError(f"trace {t.question_id}: matches, available and output_ids differ in length")
    except (TypeError, ValueError) as exc:
        raise SpecPilotError(f"corrupt trace file {path}: {exc}") from None
    return traces, data.get("meta", {})


def trace_dtype(meta: dict) -> str:
    """The dtype the traces were recorded in ('torch.float32' for files from before it was recorded: the CPU's)."""
    return str(meta.get("dtype") or "torch.float32")


def model_identity(name: str) -> str:
    """A target's name without the kernel mark its loader adds (' [small-rows gemm]'): the weights, not the path."""
    return name.split(" [")[0].strip()


def load_draft_traces(path: str | Path, draft_name: str, min_tokens: int = 0,
                      temperature: float | None = None, target_name: str | None = None) -> tuple[list[Trace], dict]:
    """The traces at `path`, checked to be this draft's (and, with `target_name`, this target's: acceptance is a
    property of the pair), to hold at least `min_tokens` per prompt and, unless `temperature` is None, to be
    recorded at that temperature (0: greedy). The prompts a trained head learned from are marked as split
    `draft-train` in the returned meta, so that nothing is tuned on them."""
    traces, meta = load_traces(path)
    if meta.get("draft") != draft_name:
        raise SpecPilotError(f"traces {path} were recorded with draft '{meta.get('draft')}', not '{draft_name}'")
    recorded = model_identity(str(meta.get("target") or ""))
    if target_name is not None and recorded and recorded != model_identity(target_name):
        raise SpecPilotError(f"traces {path} were recorded with target '{recorded}', not '{model_identity(target_name)}': "
                             "record this pair's (python scripts/profile_device.py --target T --draft D) or pass --traces")
    if meta.get("max_new_tokens", 0) < min_tokens:
        raise SpecPilotError(f"traces {path} hold {meta.get('max_new_tokens')} tokens per prompt, fewer than {min_tokens}")
    if temperature is not None and trace_temperature(meta) != temperature:
        raise SpecPilotError(f"traces {path} were recorded at temperature {trace_temperature(meta):g}, not {temperature:g} "
                             "(scripts/profile_device.py --no-costs --temperature T records them)")
    return traces, mark_draft_training(traces, meta)


def mark_draft_training(traces: list[Trace], meta: dict) -> dict:
    """The traces' meta with the train-split prompts that their draft, a trained head, learned from marked as split
    `draft-train` (HeadConfig.distilled_on): no rule or policy is tuned on them (they flatter the head)."""
    head = head_config_of(str(meta.get("draft") or ""))
    if head is None:
        return meta
    splits = dict(meta.get("splits") or {})
    for t in traces:
        if splits.get(t.question_id, "train") == "train" and head.distilled_on(t.question_id, t.category):
            splits[t.question_id] = "draft-train"
    return {**meta, "splits": splits}


def traces_report_confidence(traces: list[Trace]) -> bool:
    """Whether the draft that recorded these traces reports a confidence below 1 (a model draft; prompt lookup never)."""
    return any(c < 1.0 for t in traces for cs in t.confidences for c in cs)


def train_traces(traces: list[Trace], meta: dict) -> list[Trace]:
    """The traces of train-split prompts (all of them when the file does not record splits), never those a trained
    head learned from (`mark_draft_training`)."""
    splits = mark_draft_training(traces, meta).get("splits") or {}
    kept = [t for t in traces if splits.get(t.question_id, "train") == "train"]
    if not kept and "draft-train" in splits.values():
        raise SpecPilotError(f"the draft '{meta.get('draft')}' learned from every train-split trace: none is left to tune on")
    return kept or traces


def load_profile(path: str | Path, device_key: str | None = None) -> dict:
    """A cost profile (scripts/profile_device.py); with `device_key`, checked to be that device's."""
    profile = read_json_file(path, "cost profile", f"run: python scripts/profile_device.py --device {device_key or 'auto'}",
                             keys=("context_lens", "verify_s", "draft_s_per_token"))
    if device_key is not None and profile.get("device") != device_key:
        raise SpecPilotError(f"cost profile {path} is for device '{profile.get('device')}', not '{device_key}'")
    return profile


def profile_hardware(profile: dict) -> np.ndarray | None:
    """The hardware counters recorded with a profile (as the replay env shows them), if any."""
    if not profile.get("hardware"):
        return None
    return counters_by_name(profile["hardware"], profile.get("hardware_features"))


def grid_lookup(log_batch_sizes, context_lens, values, batch: int, context: float) -> np.ndarray:
    """values[b][c][...] of a batch x context grid at (batch, context): linear in context, then in log(batch),
    held at the grid's edges. The one lookup of every measured or simulated grid (step costs, plain steps)."""
    values = np.asarray(values, dtype=np.float64)
    flat = values.reshape(values.shape[0], values.shape[1], -1)
    at = np.array([[np.interp(context, context_lens, row[:, j]) for j in range(flat.shape[2])] for row in flat])
    if len(at) > 1:
        at = np.array([np.interp(np.log(batch), log_batch_sizes, at[:, j]) for j in range(at.shape[1])])
    return at.reshape(values.shape[2:])


class CostModel:
    """Seconds of one step that drafts k tokens and verifies k + 1, at a context length.

    verify_s[c][k] for each profiled context length c, draft_s_per_token[c]; linear in context.
    """

    def __init__(self, context_lens: list[int], verify_s: list[list[float]], draft_s_per_token: list[float],
                 batch_sizes: list[int] | None = None, batch_verify_s: list[list[float]] | None = None,
                 batch_draft_s: list[float] | None = None, grid: dict | None = None):
        self.context_lens = np.asarray(context_lens, dtype=np.float64)
        self.verify_s = np.asarray(verify_s, dtype=np.float64)
        self.draft_s = np.asarray(draft_s_per_token, dtype=np.float64)
        self.k_max = self.verify_s.shape[1] - 1
        self._buckets: dict[tuple[int, int], tuple[np.ndarray, float]] = {}
        # batch scaling, measured at one context length: cost(b, k, c) = cost(1, k, c) * scale[b][k]
        self.batch_sizes = list(batch_sizes or [1])
        if batch_verify_s:
            bv = np.asarray(batch_verify_s, dtype=np.float64)[:, : self.k_max + 1]
            self.batch_scale = bv / bv[self.batch_sizes.index(1)] if 1 in self.batch_sizes else bv / bv[0]
            bd = np.asarray(batch_draft_s or [0.0] * len(self.batch_sizes), dtype=np.float64)
            base = bd[self.batch_sizes.index(1)] if 1 in self.batch_sizes else bd[0]
            self.batch_draft_scale = bd / base if base > 0 else np.ones_like(bd)
        else:
            self.batch_scale = np.ones((1, self.k_max + 1))
            self.batch_draft_scale = np.ones(1)
        # a full batch x context grid (simulated profiles, and measured ones with profile --grid-context-lens):
        # cost(b, k, c) looked up in it directly, since the KV cache makes the batch and context effects
        # interact (no one scale per batch size)
        self.grid = None
        if grid:
            self.grid = (np.log(np.asarray(grid["batch_sizes"], dtype=np.float64)),
                         np.asarray(grid["context_lens"], dtype=np.float64),
                         np.asarray(grid["verify_s"], dtype=np.float64)[:, :, : self.k_max + 1],
                         np.asarray(grid["draft_s_per_token"], dtype=np.float64))
            self.batch_sizes = list(grid["batch_sizes"])

    def _grid_costs(self, context: float, batch: int) -> tuple[np.ndarray, float]:
        """(verify seconds for k = 0..k_max, draft seconds per token), bilinear in log(batch) and context."""
        log_b, contexts, verify, draft = self.grid
        return grid_lookup(log_b, contexts, verify, batch, context), float(grid_lookup(log_b, contexts, draft, batch, context))

    @property
    def max_batch(self) -> int:
        return max(self.batch_sizes)

    def _batch_factors(self, batch: int) -> tuple[np.ndarray, float]:
        """(verify scale per k, draft scale) at a batch size, interpolated in log(batch)."""
        if len(self.batch_sizes) == 1:
            if batch != self.batch_sizes[0]:
                raise SpecPilotError("the cost profile has no batch sizes; profile them (profile_device.py --batch-sizes)")
            return self.batch_scale[0], float(self.batch_draft_scale[0])
        x = np.log(np.asarray(self.batch_sizes, dtype=np.float64))
        at = np.log(batch)
        scale = np.array([np.interp(at, x, self.batch_scale[:, k]) for k in range(self.k_max + 1)])
        return scale, float(np.interp(at, x, self.batch_draft_scale))

    BUCKET = 32
    """Contexts are looked up at the middle of 32-token buckets (memoised: the DP and the replay env
    ask for the same context lengths over and over)."""

    def step_costs(self, context_len: int, batch: int = 1) -> tuple[np.ndarray, float]:
        """(step seconds for k = 0..k_max, draft seconds per token) at this context length and batch size."""
        key = (int(context_len) // self.BUCKET, int(batch))
        if key not in self._buckets and self.grid is not None:
            verify, draft = self._grid_costs(key[0] * self.BUCKET + self.BUCKET // 2, batch)
            self._buckets[key] = (verify + draft * np.arange(self.k_max + 1), draft)
        if key not in self._buckets:
            c = key[0] * self.BUCKET + self.BUCKET // 2
            draft = float(np.interp(c, self.context_lens, self.draft_s))
            if batch == 1:
                self._buckets[key] = (self.table(c), draft)
            else:
                scale, draft_scale = self._batch_factors(batch)
                verify = np.array([np.interp(c, self.context_lens, self.verify_s[:, k]) for k in range(self.k_max + 1)])
                draft *= draft_scale
                self._buckets[key] = (verify * scale + draft * np.arange(self.k_max + 1), draft)
        return self._buckets[key]

    def outside(self, batch_sizes=(), context_len: int | None = None) -> str | None:
        """A one-line note when batch sizes or a context length lie beyond the profiled ones (their cost
        is then the nearest profiled one, or extrapolated linearly in context), else None."""
        notes = []
        beyond = sorted(b for b in batch_sizes if b > self.max_batch)
        if beyond:
            notes.append(f"batch sizes {beyond} lie above the profiled {self.batch_sizes} (costed as B={self.max_batch})")
        profiled = self.grid[1] if self.grid is not None else self.context_lens
        if context_len is not None and context_len > int(profiled.max()):
            notes.append(f"contexts up to {context_len} tokens lie beyond the profiled {[int(c) for c in profiled]} "
                         "(costs held at the longest)")
        return "; ".join(notes) or None

    @classmethod
    def from_profile(cls, profile: dict) -> "CostModel":
        return cls(profile["context_lens"], profile["verify_s"], profile["draft_s_per_token"],
                   profile.get("batch_sizes"), profile.get("batch_verify_s"), profile.get("batch_draft_s_per_token"),
                   profile.get("grid"))

    def table(self, context_len: int) -> np.ndarray:
        """Step seconds for k = 0..k_max at this context length (one sequence)."""
        c = float(context_len)
        verify = np.array([np.interp(c, self.context_lens, self.verify_s[:, k]) for k in range(self.k_max + 1)])
        draft = np.interp(c, self.context_lens, self.draft_s)
        return verify + draft * np.arange(self.k_max + 1)


def oracle_schedule(trace: Trace, cost: CostModel, k_max: int | None = None, context_offset: int = 0) -> tuple[float, list[int]]:
    """(minimum total seconds, k chosen at each position of the optimal path); `context_offset` simulated
    tokens sit before the prompt (the replay env's `context_len`). The DP is `hindsight_q`'s."""
    k_max = min(k_max if k_max is not None else trace.k_max, cost.k_max, trace.k_max)
    n = len(trace.output_ids)
    q = hindsight_q(trace, cost, k_max, context_offset=context_offset)
    path, i = [], 0
    while i < n:
        k = int(np.argmin(q[i]))
        path.append(k)
        i += min(min(k, trace.available[i]), trace.matches[i]) + 1
    return (float(q[0].min()) if n else 0.0), path


def hindsight_q(trace: Trace, cost: CostModel, k_max: int, budget: int | None = None, context_offset: int = 0,
                shape: np.ndarray | None = None) -> np.ndarray:
    """Q*(i, k), shape (end, k_max + 1): the seconds one row still needs from position i when it asks for k now
    and decodes optimally after (the oracle's hindsight), as the replay env steps it: k' = min(k, a(i), budget -
    i - 1) drafted, priced t(k') * shape[k'] at the row's context, min(k', m(i)) + 1 tokens kept, the row ending
    at end = min(budget, trace length). min_k Q*(0, k) is `oracle_schedule`'s total for the whole trace."""
    n = len(trace.output_ids)
    budget = n if budget is None else budget
    end = min(budget, n)
    n_prompt = context_offset + len(trace.prompt_ids)
    factors = np.ones(k_max + 1) if shape is None else np.asarray(shape, dtype=np.float64)[: k_max + 1]
    q = np.zeros((end, k_max + 1))
    best = np.zeros(end + 1)
    for i in range(end - 1, -1, -1):
        t = cost.step_costs(n_prompt + i)[0]
        for k in range(k_max + 1):
            drafted = max(0, min(k, trace.available[i], budget - i - 1))
            q[i, k] = t[drafted] * factors[drafted] + best[min(end, i + min(drafted, trace.matches[i]) + 1)]
        best[i] = q[i].min()
    return q


def plain_seconds(trace: Trace, cost: CostModel, context_offset: int = 0) -> float:
    """Plain decoding's time for the trace's output at one row (the oracle's and any replay's baseline)."""
    n_prompt = context_offset + len(trace.prompt_ids)
    return float(sum(cost.step_costs(n_prompt + i, 1)[0][0] for i in range(len(trace.output_ids))))


def truncate(trace: Trace, n: int) -> Trace:
    """The trace of the first n output tokens (a shorter generation budget)."""
    if len(trace.output_ids) <= n:
        return trace
    return Trace(trace.question_id, trace.category, trace.prompt_ids, trace.output_ids[:n],
                 [min(m, n - i - 1) for i, m in enumerate(trace.matches[:n])], trace.available[:n],
                 trace.confidences[:n], trace.entropies[:n], trace.match_lens[:n], trace.k_max, trace.ngram_n,
                 {source: {"matches": [min(m, n - i - 1) for i, m in enumerate(rows["matches"][:n])],
                           **{key: rows[key][:n] for key in ("available", "confidences", "entropies")}}
                  for source, rows in trace.sources.items()})


class OracleK(LengthPolicy):
    """Replays the oracle's schedule for a prompt whose trace was recorded (benchmarks only)."""

    name = "oracle"

    def __init__(self, traces: list[Trace], cost: CostModel, k_max: int, max_new_tokens: int | None = None):
        self.k_max = k_max
        if max_new_tokens is not None:
            traces = [truncate(t, max_new_tokens) for t in traces]
        self.schedules = {t.question_id: dict(self._positions(t, cost)) for t in traces}
        self.schedule: dict[int, int] = {}
        self.position = 0

    def _positions(self, trace: Trace, cost: CostModel):
        _, path = oracle_schedule(trace, cost, self.k_max)
        i = 0
        for k in path:
            yield i, k
            i += min(min(k, trace.available[i]), trace.matches[i]) + 1

    def prepare(self, question_id: str) -> None:
        if question_id not in self.schedules:
            raise SpecPilotError(f"oracle: no trace recorded for prompt '{question_id}'")
        self.schedule = self.schedules[question_id]

    def reset(self) -> None:
        self.position = 0

    def choose_k(self, obs) -> int:
        return self.schedule.get(self.position, 0)

    def update(self, step) -> None:
        self.position += len(step.new_tokens)
