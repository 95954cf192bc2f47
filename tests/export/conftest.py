import pytest

from helpers import FAMILIES, SHAPES
from specexport.config import BuildConfig
from specexport.export.build import build

# `engines` (the tiny ONNX + TorchScript engines) is in tests/conftest.py: test_lean.py runs them too


@pytest.fixture(scope="session")
def portable_engines(tiny, tmp_path_factory):
    """family -> the same engines as `engines` on the portable graph set (standard ONNX ops), ONNX only."""
    root = tmp_path_factory.mktemp("portable")
    return {fam: build(BuildConfig(target=tiny[fam]["target"], draft=tiny[fam]["perturbed"], ks=(1, 3),
                                   ops="portable", out=str(root / fam), **SHAPES), progress=False)["out"]
            for fam in FAMILIES}


@pytest.fixture(scope="session")
def full_head_engines(tiny, tmp_path_factory):
    """'llama' -> `engines`' llama and 'lookup' -> its lookup engine, built with the full head (`target_head="full"`):
    without the certified head's MatMulNBits an fp32 engine honours prepack=False (unpacked fp32 linears)."""
    root = tmp_path_factory.mktemp("full_head")
    kw = dict(target_head="full", **SHAPES)
    return {"llama": build(BuildConfig(target=tiny["llama"]["target"], draft=tiny["llama"]["perturbed"], ks=(1, 3),
                                       out=str(root / "llama"), **kw), progress=False)["out"],
            "lookup": build(BuildConfig(target=tiny["llama"]["target"], ks=(3,), sampling=False,
                                        out=str(root / "lookup"), **kw), progress=False)["out"]}
