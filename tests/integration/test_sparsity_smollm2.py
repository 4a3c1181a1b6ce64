"""SmolLM2 end to end: head statistics on real English prompts, and a window replay.

Nothing here asserts attention-sink folklore: the test checks what must hold by
construction and prints what was measured (docs/sparsity.md records it).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from attnprof.analyze.sparsity.classify import CLASSES, Thresholds, classify
from attnprof.analyze.sparsity.recommend import format_summary, recommend
from attnprof.analyze.sparsity.savings import LengthDistribution
from attnprof.cli import main
from attnprof.facts.shape import AttentionShape
from attnprof.tools.replay import collect_head_stats, load_model, replay

pytestmark = [pytest.mark.smollm2, pytest.mark.slow]

PROMPTS = [
    "The history of the bicycle is a story of many small improvements rather than a single "
    "invention. Early machines in the 1810s had no pedals at all: riders sat on a wooden frame "
    "and pushed themselves along with their feet. Decades later, inventors in France attached "
    "cranks and pedals directly to the front wheel, which made the machines faster but also "
    "harder to control. To go faster still, designers enlarged the front wheel, producing the "
    "famous high wheeler, a vehicle that was thrilling for young athletes and dangerous for "
    "everyone else. The breakthrough came in the 1880s with the so-called safety bicycle, which "
    "used two wheels of equal size and a chain to drive the rear wheel. Combined with the "
    "pneumatic tire, invented shortly afterwards, the safety bicycle became comfortable, "
    "efficient and affordable. Within a few years cycling clubs appeared in cities across "
    "Europe and North America, and the bicycle changed how people travelled to work, how women "
    "dressed, and even how roads were built. Road surfaces improved because cyclists organised "
    "and lobbied for them, years before cars arrived to take advantage of the smooth pavement. "
    "Question: according to the text, which two inventions made the bicycle comfortable and "
    "affordable? Answer:",
    "Dear team, thank you all for your hard work during the last quarter. I want to summarise "
    "where we stand before the planning meeting next Tuesday. First, the new checkout page went "
    "live in March and the number of abandoned carts fell by about twelve percent, which is "
    "better than we expected. Second, the mobile application still has performance problems on "
    "older phones; several customers wrote to support that the search screen freezes for a few "
    "seconds after typing. The engineering group believes the cause is an image cache that "
    "grows without limit, and they plan to fix it in the next release. Third, our warehouse "
    "partner in the north will change its delivery schedule in May, so orders placed on Friday "
    "evenings may arrive one day later than before. Please make sure the website shows the "
    "updated delivery estimates. Finally, we are hiring two more people for the customer "
    "support team, and I would appreciate it if you could share the job posting with anyone "
    "who might be interested. For the meeting, please prepare a short list of the three most "
    "important problems in your area and one idea for how to solve each of them. Best regards, "
    "Maria. Please write a two sentence summary of this email. Summary:",
    "Photosynthesis is the process by which green plants, algae and some bacteria convert "
    "light energy into chemical energy. It takes place mainly in the leaves, inside small "
    "structures called chloroplasts, which contain the green pigment chlorophyll. During the "
    "light dependent reactions, chlorophyll absorbs sunlight, and the energy is used to split "
    "water molecules into oxygen, protons and electrons. The oxygen is released into the air "
    "as a by-product, which is why forests and oceans are so important for the air we breathe. "
    "The electrons travel along a chain of proteins and help produce two energy carrying "
    "molecules, ATP and NADPH. In the second stage, known as the Calvin cycle, the plant uses "
    "ATP and NADPH to capture carbon dioxide from the air and build it into sugars. These "
    "sugars provide energy for the plant and serve as building blocks for cellulose, starch "
    "and other compounds. The rate of photosynthesis depends on the intensity of light, the "
    "concentration of carbon dioxide and the temperature. Question: what are the two products "
    "of the light dependent reactions that carry energy? Answer:",
]


def test_head_statistics_end_to_end(smollm2_dir: Path) -> None:
    model, tok, path = load_model(str(smollm2_dir))
    # the three texts, plus two ~690-token multi-document prompts built from them
    prompts = [*PROMPTS, " ".join(PROMPTS), " ".join(PROMPTS[::-1])]
    acc = collect_head_stats(model, tok, prompts, sinks_grid=(0, 1, 4, 16),
                             window_grid=(16, 32, 64, 128, 256, 512))
    assert (acc.num_layers, acc.num_kv_heads, acc.group_size) == (30, 3, 3)
    assert acc.requests.tolist() == [len(prompts)] * 30
    means = acc.per_head_means()
    sink = means["sink_mass"]
    s1, s4 = acc.sinks_grid.index(1), acc.sinks_grid.index(4)
    assert np.all((sink >= 0) & (sink <= 1 + 1e-6))
    assert np.all(sink[:, :, s4] >= sink[:, :, s1] - 1e-6)  # more sinks, more mass
    cov = acc.coverage_mean()
    assert np.all((cov[np.isfinite(cov)] > 0) & (cov[np.isfinite(cov)] <= 1 + 1e-6))
    assert np.all((means["entropy"] >= 0) & (means["entropy"] <= 1 + 1e-6))
    cls = classify(acc, Thresholds(sinks=4))
    assert sum(cls.class_counts.values()) == 30 * 3
    assert set(cls.class_counts) <= set(CLASSES)
    per_layer = sink[:, :, s1].mean(1)
    print("\nSmolLM2 first-token sink mass per layer:", np.round(per_layer, 3).tolist())
    print("share of (layer, q head) with 4-sink mass > 0.3:",
          round(float((sink[:, :, s4] > 0.3).mean()), 3))
    mean_cov = [round(float(cov[:, :, s4, i].mean()), 3) if np.isfinite(cov[:, :, s4, i]).all()
                else None for i in range(len(acc.window_grid))]
    print("mean coverage (s=4) by window", acc.window_grid, ":", mean_cov)
    print("KV-head classes:", cls.class_counts)
    lengths = [len(tok(p)["input_ids"]) + 24 for p in prompts] + [2000, 3000, 4000]
    rec = recommend(LengthDistribution.from_lengths(lengths), AttentionShape.from_model_dir(path),
                    acc).to_json()
    assert rec["heads_at_risk_count"] == 0  # windowed layers are covered by construction
    assert json.loads(json.dumps(acc.to_dict()))["num_layers"] == 30
    res = None
    if rec["layers"]:
        res = replay(model, tok, prompts, rec["window"], rec["sinks"], layers=rec["layers"])
        assert res["positions"] > 0
        assert res["safe"] == (res["agreement"] >= 0.95 and res["mean_kl"] <= 0.05
                               and res["positions"] >= 64)
    print(format_summary(rec, res))


def test_validate_window_on_smollm2(smollm2_dir: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    rc = main(["validate-window", "--window", "64", "--sinks", "4", "--model",
               str(smollm2_dir), "--prompts", str(prompts), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["positions"] > 3 * 150  # every prompt is longer than 68 tokens
    assert 0.0 <= out["agreement"] <= 1.0 and out["mean_kl"] >= 0.0
    assert out["safe"] == (out["agreement"] >= 0.95 and out["mean_kl"] <= 0.05)
    print(f"\nSmolLM2 replay, 4 sinks + 64 window on all layers: agreement "
          f"{out['agreement']:.3f}, mean KL {out['mean_kl']:.4f} over {out['positions']} "
          f"positions -> {out['verdict']}")
