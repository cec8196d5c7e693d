"""The task-suite runner on the bundled model at a tiny grid (fp32, CPU)."""

import json

import pytest

from kvlocks_lab.eval.runner import _answer
from kvlocks_lab.eval.suite import EvalConfig, run_eval

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def model_tok():
    from kvlocks.models import load

    return load("smollm2-135m")


def test_grid_rows_resume_and_exactness_at_large_budget(model_tok, tmp_path):
    model, tok = model_tok
    cfg = EvalConfig(tasks=("passkey",), lengths=(384,), budgets=(32, 512), methods=("full", "locks"), samples=1)
    summary = run_eval(cfg, tmp_path, model=model, tok=tok, progress=False)
    rows = [json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and summary["n_rows"] == 3
    from kvlocks_lab.eval.report import git_commit

    assert {r["commit"] for r in rows} == {git_commit()} and summary["row_commits"] == [git_commit()]
    by = {(r["method"], r["budget"]): r for r in rows}
    full, big, small = by[("full", None)], by[("locks", 512)], by[("locks", 32)]
    assert full["kl"] == 0 and full["exact_agree"] == 1
    # budget >= context: identical tokens and (numerically) zero KL
    assert big["tokens"] == full["tokens"] and big["kl"] < 1e-6 and big["top1"] == 1
    # two pages only (sink + recent) really read less and diverges measurably
    assert small["stats_read_fraction"] < big["stats_read_fraction"] and small["kl"] > big["kl"]
    assert big["prompt_tokens"] + 16 <= 384
    for f in ("summary.json", "results.md", "score_vs_budget.png", "kl_vs_budget.png", "depth_heatmap.png"):
        assert (tmp_path / f).exists()
    assert len(list((tmp_path / "reference").glob("*.pt"))) == 1  # full's answer, kept for later runs
    # resume: nothing is recomputed or duplicated
    run_eval(cfg, tmp_path, model=model, tok=tok, progress=False)
    assert len((tmp_path / "rows.jsonl").read_text().splitlines()) == 3


def test_first_sample_splits_a_cell_into_runs_that_merge(model_tok, tmp_path):
    model, tok = model_tok
    grid = dict(tasks=("passkey",), lengths=(320,), budgets=(32,), methods=("full", "locks"))
    whole, part = tmp_path / "whole", tmp_path / "part"
    run_eval(EvalConfig(samples=2, **grid), whole, model=model, tok=tok, progress=False)
    run_eval(EvalConfig(samples=2, first_sample=1, **grid), part, model=model, tok=tok, progress=False)
    read = lambda d: {(r["index"], r["method"]): r for r in map(json.loads, (d / "rows.jsonl").read_text().splitlines())}
    a, b = read(whole), read(part)
    assert sorted(b) == [(1, "full"), (1, "locks")]  # only the record at index 1, under its own index
    for key, row in b.items():
        assert row["tokens"] == a[key]["tokens"] and row["prompt_tokens"] == a[key]["prompt_tokens"]
    with pytest.raises(ValueError, match="first_sample=2: must be >= 0 and <= 1"):
        EvalConfig(samples=2, first_sample=2, **grid)


def test_teacher_forcing_fork_follows_reference(monkeypatch):
    import torch

    import kvlocks_lab.eval.runner as runner

    vocab = 5
    onehot = lambda t: torch.nn.functional.one_hot(torch.tensor(t), vocab).float() * 10

    class Cache:
        def __init__(self, path):
            self.path = list(path)

        def fork(self):
            return Cache(self.path)

    # the fake model always predicts (last token fed + 1) mod 5; the reference answer is 1, 2, 0, 0
    def fake_step(model, cache, token):
        cache.path.append(token)
        return onehot((token + 1) % vocab)

    monkeypatch.setattr(runner, "step", fake_step)
    cache = Cache([])
    tokens, logps = _answer(None, cache, onehot(1), 4, eos=set(), ref_tokens=[1, 2, 0, 0])
    assert tokens == [1, 2, 3, 4]  # greedy continues on its own path
    assert len(logps) == 4  # one distribution per reference position
    # positions 0-2 come from the shared path (diverging at 2); position 3 from the fork fed ref[2] = 0
    assert [int(lp.argmax()) for lp in logps] == [1, 2, 3, 1]
    assert cache.path == [1, 2, 3]


def test_a_dense_question_is_read_with_full_attention_and_the_method_selects_after_it(model_tok, tmp_path):
    """question="dense": the question's steps on a selector's cache give full attention's logits exactly
    (a serving engine prefills the prompt densely); the answer's steps select again."""
    import torch

    from kvlocks.config import LocksConfig
    from kvlocks.integrations.hf import LocksCache
    from kvlocks.integrations.hf.decode import prefill, step
    from kvlocks_lab.eval.runner import read_densely

    model, tok = model_tok
    ids = tok("The quick brown fox jumps over the lazy dog. " * 40, return_tensors="pt").input_ids[:, :400]
    with torch.inference_mode():
        cache = LocksCache(model.config, method="locks", config=LocksConfig(budget=32))
        prefill(model, cache, ids)
        full, sparse = cache.fork(method="full"), cache.fork()
        with read_densely(sparse, True):
            assert sparse.selector is None
            assert torch.equal(step(model, sparse, 11), step(model, full, 11))
        assert sparse.selector is not None  # the method selects again after the question
        assert not torch.allclose(step(model, sparse, 12), step(model, full, 12), atol=1e-3)
    cfg = EvalConfig(tasks=("passkey",), lengths=(384,), budgets=(32,), methods=("full", "locks"), samples=1,
                     question="dense")
    run_eval(cfg, tmp_path, model=model, tok=tok, progress=False)
    rows = [json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert {r["question"] for r in rows} == {"dense"}
    with pytest.raises(ValueError, match=r"EvalConfig.question='sparse': allowed \('method', 'dense'\)"):
        EvalConfig(question="sparse")
