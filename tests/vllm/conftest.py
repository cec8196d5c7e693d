"""vLLM tests run only in the vLLM venv (scripts/test_vllm.sh); elsewhere nothing here is collected.

The check imports ``vllm.LLM``, not just ``vllm``: pytest puts ``tests/`` on ``sys.path`` for this
directory, where ``import vllm`` alone would find ``tests/vllm`` itself as a namespace package.
"""

try:  # a missing or broken vLLM install (e.g. mismatched torchvision) counts as absent
    from vllm import LLM  # noqa: F401
except Exception:  # noqa: BLE001
    collect_ignore_glob = ["*"]


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def compacted_files(tmp_path_factory):
    """Compacted-cache files made with kvlocks (main venv: ``compact_ref.py``), the HF path's tokens
    after them, and the hostile files; shared by the connector and the serving-load tests.
    a: fold, T=325 -> t=48 (one full 32-token block and a partial one); b: another text, drop_refit."""
    from helpers import MAX_TOKENS, Q1, Q2, long_text, run_main

    def doc(items: int, seed: int) -> str:
        return long_text(items, seed=seed).split(" Question:")[0]

    tmp = tmp_path_factory.mktemp("compacted")
    files = tmp / "caches"
    files.mkdir()
    ref = run_main("compact_ref.py", {
        "dir": str(files), "max_tokens": MAX_TOKENS, "questions": [Q1, Q2],
        "docs": [{"name": "a", "text": doc(20, 0), "method": "fold", "t": 48},
                 {"name": "b", "text": doc(14, 5), "method": "drop_refit", "t": 40}]}, tmp, "ref")
    return {**ref, "cache_dir": str(files)}
