"""Load a saved model in a fresh Python process in which `delta_attention` cannot be imported (remote code only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

LOADER = textwrap.dedent(
    """
    import importlib.abc, json, os, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "delta_attention" or name.startswith("delta_attention."):
                raise ImportError("delta_attention is blocked in this process")
    sys.meta_path.insert(0, Block())
    try:
        import delta_attention
        raise SystemExit("delta_attention was importable")
    except ImportError:
        pass
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
    folder, ids, out = sys.argv[1], torch.tensor(json.loads(sys.argv[2])), sys.argv[3]
    lm = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    base = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
    assert "delta_attention" not in type(lm).__module__, type(lm).__module__
    has_tokenizer = os.path.exists(os.path.join(folder, "tokenizer.json"))
    with torch.no_grad():
        result = {"logits": lm(ids).logits, "hidden": base(ids).last_hidden_state,
                  "classes": [type(lm).__name__, type(base).__name__],
                  "vocab": len(AutoTokenizer.from_pretrained(folder)) if has_tokenizer else 0}
    result["generated"] = lm.generate(ids[:1, :6], max_new_tokens=8, do_sample=False)
    torch.save(result, out)
    """
)


def load_isolated(folder: str | Path, input_ids: list[list[int]], work_dir: str | Path) -> dict:
    """Logits, base-model hidden states, a greedy continuation and class names computed in a fresh process
    with `HF_HUB_OFFLINE=1`, `trust_remote_code=True` and `delta_attention` blocked; fails with its stderr."""
    out = Path(work_dir) / "isolated.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", LOADER, str(folder), json.dumps(input_ids), str(out)], env=env,
                          capture_output=True, text=True, cwd=str(work_dir))
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out)
