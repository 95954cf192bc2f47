#!/usr/bin/env python
"""How close each quantized-copy setting is to its target (eager torch, dequantized weights):
relative weight error over all linear layers, and teacher-forced top-1 agreement with the target over the
prompt set (chat template, every position of every prompt). The draft's cost relative to the target is a
runtime figure: `specexport bench` reports it per setting ("draft pass / target pass").

--int8-inputs also rounds each linear's input as ONNX Runtime's MatMulNBits does with int8 activations
(accuracy_level 4): per block of the layer's block size, to int8 at max|x| / 127. The engines' drafts compute
that way, so this agreement is the one their acceptance follows (stop 32, the bench prompts: the int8:b128 copy's
0.988 without, 0.960 with).

    python tools/quant_report.py [--prompts FILE] [--int8-inputs] [SPEC ...]     # default: the settings below
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specexport.models import KVCache, load_model  # noqa: E402
from specexport.config import QuantSpec  # noqa: E402
from specexport.models.quant import QuantLinear, quantize_model  # noqa: E402
from specexport.models.smooth import smoothed_copy  # noqa: E402

SETTINGS = ["quant:int4:b32:asym", "quant:int4:b32:sym", "quant:int4:b128:asym", "quant:int8:b32:sym",
            "quant:int8:b128:asym"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("specs", nargs="*", default=SETTINGS)
    ap.add_argument("--prompts", default=str(ROOT.parent / "shared" / "bench" / "prompts.jsonl"))
    ap.add_argument("--max-tokens", type=int, default=512, help="positions per prompt")
    ap.add_argument("--int8-inputs", action="store_true", help="round each linear's input to int8 per block")
    a = ap.parse_args()
    if a.int8_inputs:
        QuantLinear.forward = _int8_input_forward
    torch.set_num_threads(2)
    target = load_model(None, "fp32", 2048)
    tok = target.tokenizer
    seqs = []
    for line in Path(a.prompts).read_text().splitlines():
        if line.strip():
            text = tok.apply_chat_template([{"role": "user", "content": json.loads(line)["prompt"]}],
                                           add_generation_prompt=True, tokenize=False)
            seqs.append(torch.tensor(tok(text, add_special_tokens=False).input_ids[:a.max_tokens])[None])

    def argmax(model, ids):
        cache = KVCache.allocate(model.cfg, 1, 2048, torch.float32)
        with torch.inference_mode():
            return model(ids, torch.zeros(1, dtype=torch.long), cache, ids.shape[1])[0].argmax(-1)

    ref = [argmax(target.model, s) for s in seqs]
    weights = {n: m.weight.detach() for n, m in target.model.named_modules() if isinstance(m, torch.nn.Linear)}
    print("| setting | relative weight error | top-1 agreement (teacher-forced) | positions |")
    print("|---|---|---|---|")
    for spec in a.specs:
        s = QuantSpec.parse(spec)
        model = quantize_model(smoothed_copy(target, s.smooth) if s.smooth else copy.deepcopy(target.model), s)
        err = num = 0.0
        for n, m in model.named_modules():
            if isinstance(m, QuantLinear):
                w = weights[n]
                err += (m.dequantized() - w).pow(2).sum().item()
                num += w.pow(2).sum().item()
        agree = total = 0
        for ids, r in zip(seqs, ref):
            agree += (argmax(model, ids) == r).sum().item()
            total += len(r)
        print(f"| {s.name} | {(err / num) ** 0.5:.4f} | {agree / total:.4f} | {total} |", flush=True)


def _int8_input_forward(self, x: torch.Tensor) -> torch.Tensor:
    """QuantLinear's eager forward with its input rounded per block to int8 (symmetric, scale max|x| / 127)."""
    bs, K = self.spec.block_size, x.shape[-1]
    nb = -(-K // bs)
    xb = torch.nn.functional.pad(x, (0, nb * bs - K)).reshape(*x.shape[:-1], nb, bs)
    scale = xb.abs().amax(-1, keepdim=True) / 127.0
    xb = torch.round(xb / scale.clamp_min(torch.finfo(x.dtype).tiny)) * scale
    y = xb.reshape(*x.shape[:-1], nb * bs)[..., :K] @ self.dequantized().t()
    return y if self.bias is None else y + self.bias


if __name__ == "__main__":
    main()
