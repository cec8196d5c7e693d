"""The kvlocks lab: how kvlocks is evaluated and tuned, kept apart from the product.

- :mod:`kvlocks_lab.eval`: the task suite (generators, metrics, runner, report, plots);
- :mod:`kvlocks_lab.fidelity`: the LOCKS chain of evidence on captured activations;
- :mod:`kvlocks_lab.compaction_study`: the compaction layer study;
- :mod:`kvlocks_lab.bench`: kernel and whole-model benchmarks (CUDA).

It ships in the same distribution as ``kvlocks`` but needs the ``lab`` extra
(``pip install kvlocks-lab``: matplotlib, scipy). The product (:mod:`kvlocks`) never imports
from here; the lab imports the product freely. Its commands join the ``kvlocks`` CLI through the
``kvlocks.commands`` entry-point group.
"""

LAB_EXTRAS = ("matplotlib", "scipy")


def require_extras() -> None:
    """Raise ``SystemExit`` naming the missing lab extras (``pip install kvlocks-lab``)."""
    import importlib.util

    missing = [m for m in LAB_EXTRAS if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"the kvlocks lab needs {', '.join(missing)}, which is not installed: "
                         f"pip install kvlocks-lab")
