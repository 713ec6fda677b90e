"""Hydra callback: at the end of a multirun, print the reconcile summary of the whole sweep."""
from __future__ import annotations

from hydra.experimental.callback import Callback


class ReconcileCallback(Callback):
    def on_multirun_end(self, config, **kwargs) -> None:
        import records
        from analysis import reconcile

        sweep_dir = config.hydra.sweep.dir
        recs = records.load(sweep_dir)
        if not recs:
            return
        df = reconcile.table(recs)
        print(f"\n== reconcile: {sweep_dir} (every row: python -m analysis.reconcile {sweep_dir}) ==")
        if len(df):
            print(reconcile.render(reconcile.compact(recs, df), "markdown"))
            print()
        print(reconcile.render(reconcile.summary(recs, df), "markdown"))
