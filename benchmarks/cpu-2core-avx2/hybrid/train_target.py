"""The small hybrid target of run.sh: Qwen3.5-shaped (hidden 256, 4 layers, 3 of them Gated DeltaNet), the shipped
pair's tokenizer, trained briefly on standard-library modules so that its text is Python-shaped and repeats itself, as
the shipped target's does. Usage: python train_target.py OUT_DIR"""

import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from blockspec.services.training.tiny import build_tiny_family
from blockspec.services.training.train_target import lm_loss, sample_batch

STEPS = 500
out = Path(sys.argv[1])
stdlib = Path(sysconfig.get_paths()["stdlib"])
tok = AutoTokenizer.from_pretrained("models/base/target")
build_tiny_family(out, "qwen3_5", tokenizer=tok, hidden_size=256, num_layers=4, max_position_embeddings=2048)
model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
ids = np.asarray(tok.encode("\n".join(f.read_text(encoding="utf-8") for f in sorted(stdlib.glob("[a-m]*.py")))))
opt, rng, start = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95)), np.random.default_rng(0), time.time()
for step in range(STEPS):
    loss = lm_loss(model, sample_batch(ids, rng, 8, 128))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
print(f"target: {len(ids)} corpus tokens, {STEPS} steps of 8 x 128, loss {float(loss):.2f}, {time.time() - start:.0f} s")
model.save_pretrained(out)
