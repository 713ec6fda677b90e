"""Every golden case predicts exactly what tests/golden_predictions.jsonl.gz holds: prediction.json's
text byte for byte, the printed table, or the same refusal (tests/golden.py says how to regenerate it
when a rule changes on purpose)."""
from tests import golden


def test_corpus_is_broad():
    cases = golden.corpus()
    names = [n for n, _ in cases]
    assert len(cases) >= 150
    for family in ("megatron/", "deepspeed/", "titan/", "megatron-moe/", "deepspeed-moe/", "titan-moe/", "textbook/"):
        assert any(n.startswith(family) for n in names), family


def test_predictions_match_the_golden_file():
    stored = golden.load()
    now = golden.predict_all()
    problems = golden.diff(stored, now)
    assert not problems, f"{len(problems)} of {len(now)} cases differ:\n" + "\n".join(problems[:20])
    # the corpus predicts peaks, not resident state only: most faithful predictions carry one
    peaks = sum('"peak": {' in v.get("prediction", "") for v in now.values())
    assert peaks >= 100, peaks
