import pytest


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
