"""The coordinator's tokenizer, loaded without torch, encodes exactly as the one loaded with it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from coordinator.prompts import ChatTurn, encode_prompt
from specserve.model_loading import (
    default_cache_root,
    eos_token_ids,
    load_tokenizer,
    materialize,
    resolve_model,
    vocab_fingerprint,
)
from tests.integration.conftest import spec_bench_prompts

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import json, sys
from pathlib import Path
from coordinator.prompts import ChatTurn, encode_prompt
from specserve.model_loading import eos_token_ids, load_tokenizer_without_torch, resolve_model, vocab_fingerprint
source, tokenizer = load_tokenizer_without_torch(resolve_model("smollm2"), Path(sys.argv[1]))
texts = json.loads(sys.stdin.read())
print(json.dumps({
    "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch" and sys.modules[m] is not None),
    "fingerprint": vocab_fingerprint(tokenizer),
    "eos": sorted(eos_token_ids(source, tokenizer)),
    "chat": [encode_prompt(tokenizer, None, [ChatTurn("user", t)]) for t in texts],
    "plain": [encode_prompt(tokenizer, t, None) for t in texts],
}))
"""


def test_the_tokenizer_loads_without_torch_and_encodes_the_same() -> None:
    texts = [record["turns"][0] for record in spec_bench_prompts(per_category=2)]
    texts += [" leading space", "emoji 🦙 and <|im_end|> inside", "ünïcödé\ttabs\n\nnewlines"]
    cache_root = default_cache_root()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(cache_root)],
        input=json.dumps(texts),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    child = json.loads(done.stdout)
    assert child["torch"] == []
    source = materialize(resolve_model("smollm2"), cache_root)
    tokenizer = load_tokenizer(source)
    assert child["fingerprint"] == vocab_fingerprint(tokenizer)
    assert child["eos"] == sorted(eos_token_ids(source, tokenizer))
    assert child["chat"] == [encode_prompt(tokenizer, None, [ChatTurn("user", t)]) for t in texts]
    assert child["plain"] == [encode_prompt(tokenizer, t, None) for t in texts]
