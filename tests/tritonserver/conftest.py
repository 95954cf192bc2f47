import pytest

from helpers import make_tiny, word_tokenizer
from specexport.config import BuildConfig
from specexport.export.build import build

WORDS = [f"w{i}" for i in range(96)]


@pytest.fixture(scope="session")
def texty_engine(tmp_path_factory):
    """A tiny llama with a word tokenizer (and a chat template) + a perturbed draft with the same tokenizer,
    built into an ONNX engine: k=3, max_batch 4, so 16 clients queue."""
    root = tmp_path_factory.mktemp("texty_engine")
    tok = word_tokenizer(WORDS)
    tok.chat_template = "{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}"
    kw = dict(logit_scale=4.0, tie_word_embeddings=False, tokenizer=tok)
    hf = make_tiny(root / "target", "llama", seed=21, **kw)
    make_tiny(root / "draft", "llama", seed=22, perturb_from=hf, perturb=0.003, **kw)
    out = root / "engine"
    build(BuildConfig(target=str(root / "target"), draft=str(root / "draft"), ks=(3,), max_seq_len=96, max_batch=4,
                      prefill_chunk=16, out=str(out)), progress=False)
    return str(out)


@pytest.fixture(scope="session")
def server(texty_engine, tmp_path_factory):
    """The real tritonserver (from nvidia-pytriton) on 127.0.0.1 with free ports, over a repository holding the
    speculative model (k=3, so its stats match the offline runtime's), a target-only one, one written with the
    defaults (k=auto), and one with a single cache row that only the metrics tests use (they count its requests)."""
    pytest.importorskip("pytriton", reason="the Triton tests need the [triton] extra (nvidia-pytriton)")
    from specexport.triton.repository import write_repository
    from specexport.triton.server import start_server
    repo = tmp_path_factory.mktemp("repo")
    write_repository(texty_engine, str(repo), name="specexport", threads=1, k=3)
    write_repository(texty_engine, str(repo), name="target_only", threads=1, speculative=False)
    write_repository(texty_engine, str(repo), name="auto", threads=1)
    write_repository(texty_engine, str(repo), name="metered", threads=1, k=3, max_batch=1)  # one row: requests queue
    srv = start_server(str(repo), workdir=str(tmp_path_factory.mktemp("triton_work")))
    try:
        srv.wait_ready(300)
        yield srv
    finally:
        srv.stop()
