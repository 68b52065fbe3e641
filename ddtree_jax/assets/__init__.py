"""The embedded model shipped with the package: a stdlib-trained Qwen3 target, its DFlash drafter and
their byte-level BPE tokenizer (HF-format directories, see the README's "The embedded model").

``TARGET_DIR`` and ``DRAFTER_DIR`` are the defaults of every command's ``--target`` and
``--drafter``; ``TOKENIZER_PATH`` is the tokenizer the training scripts start from (the target
directory carries a copy).
"""

from pathlib import Path

ROOT = Path(__file__).parent
TARGET_DIR = ROOT / "target"
DRAFTER_DIR = ROOT / "drafter"
TOKENIZER_PATH = ROOT / "tokenizer.json"
