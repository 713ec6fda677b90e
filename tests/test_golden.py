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


def _peaks(pred: dict):
    """Every peak of a prediction.json: each rank class's steady peak and its first step's."""
    for cls in pred.get("rank_classes") or pred.get("per_rank") or []:
        pk = cls.get("peak")
        while pk:
            yield pk
            pk = pk.get("first")


def test_every_peak_explains_itself():
    """A peak's detail lines add up to its parts: for every peak every ledger predicts in the golden
    corpus (which test_predictions_match_the_golden_file holds equal to what the code predicts now),
    each part equals the sum of the detail lines named under it ("temporary/..."); lines under other
    names (DeepSpeed's "candidate/" moments) are notes beside the sum."""
    import json

    checked, wrong = 0, []
    for case, v in golden.load().items():
        if "prediction" not in v:
            continue
        for pk in _peaks(json.loads(v["prediction"])):
            for part, b in pk["parts"].items():
                lines = sum(x for k, x in pk["detail"].items() if k.split("/", 1)[0] == part)
                checked += 1
                if lines != b:
                    wrong.append(f"{case}: {part} {b:,} B, its detail lines {lines:,} B")
    assert checked > 1000
    assert not wrong, f"{len(wrong)} parts:\n" + "\n".join(wrong[:20])
