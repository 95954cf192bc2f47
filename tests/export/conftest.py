import pytest

from helpers import FAMILIES
from specexport.config import BuildConfig
from specexport.export.build import build

SHAPES = dict(max_seq_len=128, max_batch=4, prefill_chunk=16)


@pytest.fixture(scope="session")
def engines(tiny, tmp_path_factory):
    """family -> engine folder (target + perturbed draft, k in {1, 3}, ONNX (fused graph set) + TorchScript); plus
    'lookup' -> a prompt-lookup engine (llama, k=3) built greedy-only."""
    root = tmp_path_factory.mktemp("engines")
    out = {}
    for fam in FAMILIES:
        cfg = BuildConfig(target=tiny[fam]["target"], draft=tiny[fam]["perturbed"], ks=(1, 3),
                          formats=("onnx", "torchscript"), out=str(root / fam), **SHAPES)
        out[fam] = build(cfg, progress=False)["out"]
    cfg = BuildConfig(target=tiny["llama"]["target"], ks=(3,), sampling=False, out=str(root / "lookup"), **SHAPES)
    out["lookup"] = build(cfg, progress=False)["out"]
    return out


@pytest.fixture(scope="session")
def portable_engines(tiny, tmp_path_factory):
    """family -> the same engines as `engines` on the portable graph set (standard ONNX ops), ONNX only."""
    root = tmp_path_factory.mktemp("portable")
    return {fam: build(BuildConfig(target=tiny[fam]["target"], draft=tiny[fam]["perturbed"], ks=(1, 3),
                                   ops="portable", out=str(root / fam), **SHAPES), progress=False)["out"]
            for fam in FAMILIES}
