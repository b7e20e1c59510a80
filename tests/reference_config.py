"""TEST HELPER: a reference library's config as its own serializer writes it.

`saved_config(config)` runs `config.save_pretrained` (transformers', or NeMo AutoModel's,
which is transformers underneath) into a temporary folder and returns the config.json it
wrote. Parity and contract tests load that, never a dict written to suit our reader
(`to_dict()` is not what users' files hold either: `save_pretrained` writes a diff against
the defaults, under transformers 5's key names).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path


def saved_config(config) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        return json.loads((Path(tmp) / "config.json").read_text())
