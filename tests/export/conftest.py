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
