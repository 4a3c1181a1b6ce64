"""``attnprof validate-heads``: the built tiny model end to end, input errors, and SmolLM2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnprof.cli import main
from tests.unit.analyze.test_underused_heads import BOS, DORMANT, TWINS, build_model

PROMPT_FILE_LINES = 4


def _tokenizer(out: Path) -> None:
    """Word-level tokenizer over the model's 64 ids that puts <s> (id 1) first, so every
    prompt starts with the BOS marker the dormant head reads."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from attnprof.tools.traffic import _WORDS

    words = sorted(set(_WORDS))[:61]
    vocab = {"<unk>": 0, "<s>": BOS, "</s>": 2} | {w: i + 3 for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
        ("<s>", BOS)])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(out)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    import random

    from attnprof.tools.traffic import _WORDS

    d = tmp_path_factory.mktemp("underused")
    build_model(d)
    _tokenizer(d)
    rng = random.Random(3)
    words = sorted(set(_WORDS))[:61]
    prompts = d / "prompts.txt"
    prompts.write_text("\n".join(" ".join(rng.choice(words) for _ in range(150))
                                 for _ in range(PROMPT_FILE_LINES)) + "\n")
    return d, prompts


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_finds_and_replays_the_built_heads(tiny: tuple[Path, Path], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    model, prompts = tiny
    rc, out, _ = _run(["validate-heads", "--model", str(model), "--prompts", str(prompts),
                       "--json", "--out", str(tmp_path / "r.json")], capsys)
    assert rc == 0
    res = json.loads(out)
    assert json.loads((tmp_path / "r.json").read_text()) == res
    rows = {(r["kind"], r["layer"], r["head"], r["twin"]): r for r in res["replay"]["results"]}
    assert set(rows) == {("dormant", *DORMANT, None), ("redundant", TWINS[0], TWINS[2],
                                                       TWINS[1])}
    for r in rows.values():
        assert r["safe"] and r["agreement"] >= 0.99 and r["mean_kl"] <= 0.01
        assert r["kv_share"] == pytest.approx(1 / 8)
    assert res["replay"]["positions"] == PROMPT_FILE_LINES * 151
    assert res["replay"]["combined"]["safe"]
    # the table names both heads and their verdicts
    rc, out, _ = _run(["validate-heads", "--model", str(model), "--prompts", str(prompts)],
                      capsys)
    assert rc == 0
    assert "1 dormant, 0 near-uniform, 1 redundant" in out
    assert out.count("  safe") == 2 and "NOT safe" not in out


def test_given_heads_are_replayed(tiny: tuple[Path, Path],
                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A sharp random head replaced by its mean is NOT safe: the replay can say no."""
    model, prompts = tiny
    rc, out, _ = _run(["validate-heads", "--model", str(model), "--prompts", str(prompts),
                       "--heads", "0.2,0.1~0", "--json"], capsys)
    assert rc == 0
    res = json.loads(out)
    assert res["underused"] is None
    r = {(x["layer"], x["head"]): x for x in res["replay"]["results"]}
    assert r[(0, 1)]["safe"] and r[(0, 1)]["mean_kl"] < 1e-9
    # random weights give near-flat logits: the head's loss shows in the argmax first
    assert not r[(0, 2)]["safe"] and r[(0, 2)]["agreement"] < 0.99
    assert r[(0, 2)]["mean_kl"] > 0


@pytest.mark.parametrize("argv,needle", [
    (["--model", "/nonexistent/model"], "does not exist"),
    (["--heads", "3"], "expected LAYER.HEAD"),
    (["--heads", "0.9"], "heads 0..3"),
    (["--heads", "0.1~1"], "its own twin"),
    (["--heads", "0.1,0.1"], "listed twice"),
    (["--max-kl", "nan"], "--max-kl"),
    (["--heads", "0.1", "--head-stats", "x.json"], "alternatives"),
])
def test_bad_inputs_are_one_line_exit_2(tiny: tuple[Path, Path], argv: list[str], needle: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    model, prompts = tiny
    base = ["validate-heads", "--model", str(model), "--prompts", str(prompts)]
    rc, out, err = _run(base + argv, capsys)
    assert rc == 2 and out == ""
    assert needle in err and len(err.strip().splitlines()) == 1, err


def test_nothing_to_validate(tiny: tuple[Path, Path], tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    from attnprof.aggregate.head_stats import HeadStatsAccumulator

    model, prompts = tiny
    empty = tmp_path / "stats.json"
    empty.write_text(json.dumps(HeadStatsAccumulator(2, 2, 2).to_dict()))
    out_file = tmp_path / "never.json"
    rc, out, err = _run(["validate-heads", "--model", str(model), "--prompts", str(prompts),
                         "--head-stats", str(empty), "--out", str(out_file)], capsys)
    assert rc == 2 and out == "" and not out_file.exists()
    assert "nothing to validate" in err and len(err.strip().splitlines()) == 1


def test_head_stats_without_the_dormant_sinks_is_one_line(
        tiny: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Statistics whose sinks grid lacks the dormant test's 4 first tokens: an input error,
    not a traceback, and nothing written."""
    from attnprof.aggregate.head_stats import HeadStatsAccumulator

    model, prompts = tiny
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps(HeadStatsAccumulator(2, 2, 2, sinks_grid=(1, 2)).to_dict()))
    out_file = tmp_path / "never.json"
    rc, out, err = _run(["validate-heads", "--model", str(model), "--prompts", str(prompts),
                         "--head-stats", str(stats), "--out", str(out_file)], capsys)
    assert rc == 2 and out == "" and not out_file.exists()
    assert err.startswith("attnprof: error: --head-stats: sinks=4")
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.smollm2
@pytest.mark.slow
def test_smollm2_finding_with_replay_numbers(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Head statistics on one real text, the underused heads found, each replayed. What
    must hold: every finding has replay numbers and 'safe' follows them; SmolLM2's layer 18
    head 8 puts all its mass on the first tokens (measured: 596/596 sampled queries), so it
    is found dormant."""
    from tests.integration.test_sparsity_smollm2 import PROMPTS

    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(PROMPTS[:1]))
    rc, out, err = _run(["validate-heads", "--prompts", str(prompts), "--max-tokens", "256",
                         "--json"], capsys)
    assert rc == 0, err
    res = json.loads(out)
    rows = res["replay"]["results"]
    assert rows and len(rows) == len(res["underused"]["findings"][:16])
    for r in rows:
        meets = r["agreement"] >= 0.99 and r["mean_kl"] <= 0.01
        assert r["safe"] == (meets and res["replay"]["positions"] >= 64)
        assert 0 < r["kv_share"] < 1
    dormant = {(r["layer"], r["head"]) for r in rows if r["kind"] == "dormant"}
    assert (18, 8) in dormant
    print(json.dumps(rows, indent=1))
