"""vLLM tests run only in the vLLM venv (scripts/test_vllm.sh); elsewhere nothing here is collected.

The check imports ``vllm.LLM``, not just ``vllm``: pytest puts ``tests/`` on ``sys.path`` for this
directory, where ``import vllm`` alone would find ``tests/vllm`` itself as a namespace package.

With ``KVLOCKS_INSTALLED_WHEEL=1`` (scripts/test_vllm.sh sets it: .venv-vllm holds the kvlocks and
kvlocks-lab wheels) the run stops at once unless both are imported from this interpreter's
site-packages rather than from the checkout; without it any install counts (an editable one too).
"""

try:  # a missing or broken vLLM install (e.g. mismatched torchvision) counts as absent
    from vllm import LLM  # noqa: F401
except Exception:  # noqa: BLE001
    collect_ignore_glob = ["*"]


import pytest  # noqa: E402
from installed import check_installed  # noqa: E402

if "collect_ignore_glob" not in globals():
    check_installed()


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
