"""scripts/gpu/serve_check.py reads the plugin's log: its patterns match the messages the product logs."""

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM = ROOT / "src" / "kvlocks" / "integrations" / "vllm"
sys.path.insert(0, str(ROOT / "scripts" / "gpu"))
import serve_check  # noqa: E402


def log_formats(folder: Path) -> list[str]:
    """String constants in ``folder``'s modules that start like a kvlocks log message."""
    found = []
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("kvlocks: "):
                found.append(node.value)
    return found


def test_registration_message_is_recognised():
    (fmt,) = [f for f in log_formats(VLLM) if "backend registered for" in f]
    rendered = re.sub(r"%[-.\d]*[sdrf]", "LocksConfig(budget=256)", fmt.replace("%s", "FLASH_ATTN", 1))
    line = "INFO 2026-12-06 [kvlocks.integrations.vllm.plugin] " + rendered
    assert serve_check.REGISTERED.search(line).group(1) == "FLASH_ATTN"
    assert serve_check.KVLOCKS_LINE.search(line)


def test_each_backend_logs_a_message_that_counts_as_active():
    for backend in ("cuda", "cpu"):
        active = [f for f in log_formats(VLLM / backend) if serve_check.ACTIVE.search(f)]
        assert active, f"no kvlocks log message under {VLLM / backend} matches serve_check.ACTIVE"
    assert not serve_check.ACTIVE.search("kvlocks: LOCKS attention backend registered for CPU_ATTN")


def test_paths_are_not_kvlocks_log_lines():
    assert not serve_check.KVLOCKS_LINE.search("INFO [vllm.launcher] serving model /tmp/kvlocks-stage/models/x")


def test_prompt_asks_for_a_word_it_contains():
    text, word = serve_check.prompt()
    assert text.count(f"holds the word {word}.") >= 1 and len(text.split()) > 500  # ~1,700 tokens: past a 256-token budget
