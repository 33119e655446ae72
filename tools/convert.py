"""Convert checkpoints between Hugging Face Qwen3/Qwen3-MoE and Megatron-Core.

    python tools/convert.py hf-to-megatron HF_DIR MEGATRON_DIR [--tp N --pp N --ep N]
    python tools/convert.py megatron-to-hf MEGATRON_DIR HF_DIR [--tokenizer-from DIR]

A thin wrapper over :func:`megatron_gspo.weights.convert.main`. The ``__main__`` guard matters:
torch's multiprocessing may start processes that re-import this file.
"""

import sys
from pathlib import Path

# Run from a checkout: prefer this checkout's package over an installed one.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_gspo.weights.convert import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
