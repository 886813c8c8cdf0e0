"""What-if on recorded runs: expert cache replay, latency fit, precision probe, code view (workbench.analysis.whatif,
workbench.analysis.codeview) and the expert-cache command."""
from __future__ import annotations

import io
import json
import keyword
import tokenize

import numpy as np
import polars as pl
import pytest
import torch
from helpers import tiny_model

import workbench
from workbench.analysis import codeview, precision, whatif
from workbench.model import load_tokenizer

# -- expert cache ------------------------------------------------------------------------------------

# layer 1 and layer 2 of a hand-made top-2 routing table, five tokens each (slot 0 first)
LAYER_1 = [[0, 1], [0, 2], [1, 2], [0, 1], [3, 0]]
LAYER_2 = [[5, 6], [5, 6], [6, 7], [5, 6], [5, 6]]


def hand_routing() -> pl.DataFrame:
    rows = [{"pos": pos, "layer": layer, "slot": slot, "expert": e, "weight": 0.5}
            for layer, seq in ((1, LAYER_1), (2, LAYER_2)) for pos, experts in enumerate(seq)
            for slot, e in enumerate(experts)]
    return pl.DataFrame(rows).sample(fraction=1.0, shuffle=True, seed=3)  # the replay sorts by itself


def hits(df: pl.DataFrame) -> dict:
    return {(r["layer"], r["slots"]): (r["lookups"], r["hits"]) for r in df.iter_rows(named=True)}


def test_lru_replay_equals_hand_computation():
    r = hand_routing()
    # Worked by hand (cache listed least -> most recently used):
    # none, K=2, layer 1: t0 0m 1m [0,1]; t1 0h 2m [0,2]; t2 1m 2h [1,2]; t3 0m 1m [0,1]; t4 3m 0m -> 2 hits
    # none, K=3, layer 1: t0 mm; t1 0h 2m [1,0,2]; t2 hh; t3 hh; t4 3m (evicts 2) 0h -> 6 hits
    # none, K=2, layer 2: t0 mm; t1 hh; t2 6h 7m [6,7]; t3 5m 6m; t4 hh -> 5 hits; K=3: 7 hits
    df = whatif.expert_cache(r, slots=[3, 2], predictor="none")
    assert df.columns == ["layer", "slots", "lookups", "hits", "hit_rate"]
    assert df["layer"].to_list() == [1, 1, 2, 2, None, None] and df["slots"].to_list() == [2, 3, 2, 3, 2, 3]
    assert hits(df) == {(1, 2): (10, 2), (1, 3): (10, 6), (2, 2): (10, 5), (2, 3): (10, 7),
                        (None, 2): (20, 7), (None, 3): (20, 13)}
    assert df.filter(pl.col("layer").is_null())["hit_rate"].to_list() == [7 / 20, 13 / 20]
    # prev3, K=2, layer 1: prefetch the 2 experts used by most of the last 3 tokens (ties: more recent, lower id)
    # t1 want [0,1]: 0h 2m; t2 want [0,2] (0 twice): 1m 2m; t3 want [1,2] (all twice, 1 and 2 nearer): 0m 1h;
    # t4 want [0,1]: 3m 0h -> 3 hits. Layer 2: t1 hh; t2 6h 7m; t3 want [6,5]: hh; t4 hh -> 7 hits.
    # K=3: layer 1 6 hits (as LRU), layer 2 7 hits.
    df = whatif.expert_cache(r, slots=[2, 3], predictor="prev3")
    assert hits(df) == {(1, 2): (10, 3), (1, 3): (10, 6), (2, 2): (10, 7), (2, 3): (10, 7),
                        (None, 2): (20, 10), (None, 3): (20, 13)}
    # lookahead, K=2, layer 1: prefetch the 2 experts most used by positions t..t+4 (ties: sooner, lower id)
    # t0 want [0,1]: hh; t1 [0,2]: hh; t2 [1,0]: 1h 2m; t3 [0,1]: hh; t4 [0,3]: hh -> 9 hits; layer 2:
    # t0-t1 [6,5] hh hh; t2 [6,5]: 6h 7m; t3 [5,6], t4 [5,6]: hh hh -> 9 hits. K=3: every lookup hits.
    df = whatif.expert_cache(r, slots=[2, 3], predictor="lookahead")
    assert hits(df) == {(1, 2): (10, 9), (1, 3): (10, 10), (2, 2): (10, 9), (2, 3): (10, 10),
                        (None, 2): (20, 18), (None, 3): (20, 20)}
    # positions before count_from warm the cache without counting: layer 1, K=2 from t3: 0m 1m 3m 0m
    df = whatif.expert_cache(r, slots=[2], predictor="none", count_from=3)
    assert hits(df) == {(1, 2): (4, 0), (2, 2): (4, 2), (None, 2): (8, 2)}
    # a cache that holds every expert misses each expert once only
    assert hits(whatif.expert_cache(r, slots=[8]))[(None, 8)] == (20, 20 - 4 - 3)
    with pytest.raises(ValueError, match="predictor"):
        whatif.expert_cache(r, predictor="belady")
    # several runs pooled: the sums of each run's counts, per predictor
    sweep = whatif.expert_cache_sweep([r, r], slots=[2], predictors=["none", "lookahead"])
    tot = sweep.filter(pl.col("layer").is_null())
    assert tot.select("predictor", "lookups", "hits").rows() == [("none", 40, 14), ("lookahead", 40, 36)]


# -- latency against context -----------------------------------------------------------------------

def test_latency_fit_recovers_parameters_from_noisy_data():
    rng = np.random.default_rng(0)
    L = np.repeat([1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072], 10)
    y = whatif.latency_model(L, 12.4, 1.38, 8.2) + rng.normal(0, 0.3, L.size)
    fit = whatif.fit_latency(pl.DataFrame({"L": L, "wall_ms": y}))
    assert fit.a == pytest.approx(12.4, rel=0.05) and fit.b == pytest.approx(1.38, abs=0.03)
    assert fit.c == pytest.approx(8.2, abs=0.3)
    for v, se, true in ((fit.a, fit.a_se, 12.4), (fit.b, fit.b_se, 1.38), (fit.c, fit.c_se, 8.2)):
        assert 0 < se < 1 and abs(v - true) < 4 * se  # standard errors that cover the truth
    assert fit.residuals.columns == ["L", "wall_ms", "fitted", "residual"] and fit.n == L.size
    assert fit.rmse == pytest.approx(0.3, rel=0.25)
    assert np.allclose(fit.residuals["wall_ms"] - fit.residuals["fitted"], fit.residuals["residual"])
    # L0 is only the unit: a fit at another L0 describes the same curve
    other = whatif.fit_latency(pl.DataFrame({"L": L, "wall_ms": y}), L0=4096)
    assert np.allclose(other.predict([3000, 90000]), fit.predict([3000, 90000]), rtol=1e-4)
    # a steps table: decode steps only, L = n_prompt_tokens + step - 1
    steps = pl.DataFrame({"step": [0, 1, 2, 3], "kind": ["prefill", "decode", "decode", "decode"],
                          "n_tokens": [7, 1, 1, 1], "wall_ms": [30.0, 2.0, 2.1, 2.2]})
    assert whatif.decode_points(steps, 7).rows() == [(1, 7, 2.0), (2, 8, 2.1), (3, 9, 2.2)]
    with pytest.raises(ValueError, match="needs"):
        whatif.fit_latency(whatif.decode_points(steps, 7))


def test_latency_fit_of_a_run_without_steps_rows_says_why(tmp_path):
    run = workbench.record([5, 6, 7, 8], model=tiny_model(), db=tmp_path / "w.duckdb", max_new_tokens=6,
                           probes=("tokens", "routing"), detect=False)
    with pytest.raises(ValueError, match="recorded without the steps probe"):
        whatif.fit_latency(run)


# -- fake quantization --------------------------------------------------------------------------------

EXACT = {
    "fp8_e4m3": [448.0, -448.0, 1.0, 0.5, -2.25, 0.0],  # max-abs 448: scale 1, all E4M3 numbers
    "int8": [k * 0.5 for k in (-127, -3, 0, 5, 127)],  # integer multiples of max-abs / 127
    "bf16": [1.0, -0.375, 256.0, 2.0 ** -15, 0.0],  # 8 significant bits at most
}
INEXACT = {"fp8_e4m3": [448.0, 1.03], "int8": [63.5, 0.3], "bf16": [1.0 + 2.0 ** -10, 3.0]}


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8", "bf16"])
def test_fake_quantization_is_exact_on_representable_values_only(fmt):
    fq = precision.FAKE_QUANT[fmt]
    x = torch.tensor(EXACT[fmt])
    before = x.clone()
    assert torch.equal(fq(x), x)
    assert torch.equal(x, before)  # pure: the input is left alone
    y = torch.tensor(INEXACT[fmt])
    assert (fq(y) - y).abs().max() > 0
    assert fq(torch.zeros(3)).eq(0).all()
    assert fq(torch.tensor(EXACT[fmt]).to(torch.bfloat16)).dtype == torch.bfloat16
    # per-tensor max-abs scaling: the error is relative to the tensor's range
    if fmt != "bf16":
        assert torch.equal(fq(x * 4.0) / 4.0, fq(x))
    assert torch.equal(precision.fake_fp32(y), y)


# -- code view ----------------------------------------------------------------------------------------

SAMPLE = ('import os\n\n\ndef f(x, y=1.5):\n    """Doc."""\n    # note\n    if x is None:\n'
          '        return [y, 0x1F]\n    return x + y  # done\n')


def expected_class(tok: tokenize.TokenInfo) -> str | None:
    return {tokenize.NAME: "keyword" if keyword.iskeyword(tok.string) else "name", tokenize.NUMBER: "number",
            tokenize.STRING: "string", tokenize.OP: "operator", tokenize.COMMENT: "comment",
            tokenize.NEWLINE: "newline", tokenize.NL: "newline", tokenize.INDENT: "indent"}.get(tok.type)


def test_token_classes_match_tokenize():
    chars = codeview.char_classes(SAMPLE)
    assert len(chars) == len(SAMPLE) and None not in chars
    starts = [0] + [i + 1 for i, ch in enumerate(SAMPLE) if ch == "\n"]
    offset = lambda row, col: starts[row - 1] + col  # noqa: E731
    covered: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(SAMPLE).readline):
        want = expected_class(tok)
        if want is None:  # DEDENT, ENDMARKER: no characters
            continue
        s, e = offset(*tok.start), offset(*tok.end)
        assert set(chars[s:e]) == {want}, (tok, chars[s:e])
        covered.update(range(s, e))
    assert len(covered) > 0.7 * len(SAMPLE)
    # the characters between tokens are whitespace: a line's leading part indent, line breaks newline
    assert {chars[i] for i in range(len(SAMPLE)) if i not in covered} <= {"indent", "whitespace", "newline"}
    assert chars[SAMPLE.index("    return x")] == "indent"  # unchanged indentation: no INDENT token
    assert chars[SAMPLE.index(" + y")] == "whitespace"
    # model tokens by character offsets: the class covering most of each token's characters
    pieces = ["import", " os", "\n\n\n", "def", " f", "(x", ",", " y", "=1.5", "):\n", "   ", ' """Doc', '."""\n',
              "    #", " note\n", "    if", " x", " is", " None", ":\n", "        return", " [", "y", ", 0x1F", "]\n",
              "    return", " x + y", "  # done\n"]
    assert "".join(pieces) == SAMPLE
    tokens = pl.DataFrame({"pos": list(range(len(pieces))), "text": pieces, "is_prompt": [False] * len(pieces),
                           "confidence": [0.5] * len(pieces), "entropy": [1.0] * len(pieces)})
    got = dict(zip(pieces, codeview.token_classes(tokens)["class"].to_list()))
    assert got["import"] == "keyword" and got[" os"] == "name" and got["\n\n\n"] == "newline"
    assert got["=1.5"] == "number" and got["   "] == "indent" and got[' """Doc'] == "string"
    assert got["    #"] == "indent" and got[" note\n"] == "comment" and got[" None"] == "keyword"
    assert got["        return"] == "indent"  # 8 spaces against 6 letters
    assert got[", 0x1F"] == "number" and got[" x + y"] == "whitespace"  # 3 spaces, 2 names, 1 operator
    assert got[" ["] == "operator" and got[" x"] == "name"  # ties: the non-blank class
    assert got["):\n"] == "operator"  # 2 operators, 1 newline
    summary = codeview.class_summary(codeview.token_classes(tokens))
    assert summary.columns == ["class", "tokens", "mean_confidence", "median_confidence", "mean_entropy",
                               "low_confidence_share"]
    assert summary["tokens"].sum() == len(pieces)
    assert summary["class"].to_list() == [c for c in codeview.CLASSES if c in set(got.values())]


def test_token_classes_survive_broken_code():
    text = 'x = """never closed\n  y'
    assert set(codeview.char_classes(text)[4:]) == {"string"}
    text = "if x:\n        a = 1\n    b = $\n"  # an inconsistent dedent, then a character tokenize rejects
    chars = codeview.char_classes(text)
    assert chars[text.index("b")] == "name" and chars[text.index("$")] == "error"


def test_compile_check_finds_the_first_error():
    ok = codeview.compile_check("def f(x):\n    return x\n")
    assert ok["ok"] and ok["status"] == "ok" and ok["line"] is None
    pieces = ["a", " =", " 1", "\n", "b", " =", " )", "\n", "c", " = (", "\n"]
    text = "".join(pieces)
    r = codeview.compile_check(text, pieces)
    assert (r["status"], r["line"], r["col"], r["offset"], r["pos"]) == ("error", 2, 5, text.index(")"), 6)
    assert "unmatched" in r["message"] and r["ok_lines"] == 1
    # cut off mid-statement: incomplete, the error where Python puts it (the bracket never closed)
    pieces = ["def", " f", "(x", "):", "\n   ", " return", " (", "x", " +", "\n"]
    text = "".join(pieces)
    r = codeview.compile_check(text, pieces, pos0=100)
    assert (r["status"], r["line"], r["col"], r["offset"], r["pos"]) == ("incomplete", 2, 12, text.index("(x +"), 106)
    r = codeview.compile_check("x = 1\ndef f(a):\n    return a +")  # ran out of input
    assert r["status"] == "incomplete" and r["line"] == 3 and r["ok_lines"] == 1
    r = codeview.compile_check("x = 1 1\ny = 2\n")
    assert r["status"] == "error" and (r["line"], r["col"]) == (1, 7)


# -- on a recorded run -------------------------------------------------------------------------------------

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    db = tmp_path_factory.mktemp("whatif") / "wb.duckdb"
    model = tiny_model(vocab_size=4096)
    return workbench.record("def add(a, b):\n    return", model=model, tokenizer=load_tokenizer(),
                            max_new_tokens=12, db=db, detect=False)


def test_cli_expert_cache_json_parses(tiny_run, capsys):
    from workbench.cli import main

    rc = main(["expert-cache", tiny_run.run_id, "--slots", "2,4", "--predictor", "all", "--json",
               "--db", str(tiny_run.store.path)])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["run_id"] == tiny_run.run_id and doc["slots"] == [2, 4]
    moe = tiny_run.model_summary.moe_layers
    assert len(doc["results"]) == 3 * 2 * (len(moe) + 1)
    for p in whatif.PREDICTORS:
        mine = [{k: v for k, v in r.items() if k != "predictor"} for r in doc["results"] if r["predictor"] == p]
        assert mine == tiny_run.expert_cache([2, 4], p).to_dicts()
    assert main(["expert-cache", tiny_run.run_id, "--slots", "2,x", "--db", str(tiny_run.store.path)]) == 2
    assert main(["expert-cache", tiny_run.run_id, "--db", str(tiny_run.store.path)]) == 0  # the text table
    assert "K=2" in capsys.readouterr().out


def test_precision_probe_on_a_recorded_run(tiny_run):
    from workbench.model import state_sha256

    model = tiny_run.model()
    sha = state_sha256(model)
    caches = [layer.attn.cache for layer in model.layers]
    df = tiny_run.precision_probe(formats=["fp32", "int8", precision.fake_bf16])
    assert df.columns == ["layer", "format", "rel_l2", "delta_nll", "top1_agreement"]
    n_layers = tiny_run.model_summary.n_layers
    assert df.height == 3 * (n_layers + 1) and df["format"].unique(maintain_order=True).to_list() == [
        "fp32", "int8", "fake_bf16"]
    exact = df.filter(pl.col("format") == "fp32")
    assert exact["delta_nll"].to_list() == [0.0] * (n_layers + 1) and exact["rel_l2"].to_list() == [0.0] * (n_layers + 1)
    assert exact["top1_agreement"].to_list() == [1.0] * (n_layers + 1)
    lossy = df.filter(pl.col("format") == "int8")
    assert (lossy["rel_l2"] > 0).all() and lossy["delta_nll"].is_finite().all()
    assert state_sha256(model) == sha  # weights put back
    assert [layer.attn.cache for layer in model.layers] == caches  # the generation's cache put back
    # each part reaches the model on its own (the KV cache through MLA's latent cache)
    for part in ("weights", "activations", "kv"):
        one = tiny_run.precision_probe(formats=["int8"], layers=[0], parts=(part,), all_layers=False)
        assert one["rel_l2"][0] > 0, part
    fig = tiny_run.fig_precision(["int8"], all_layers=False)
    assert len(fig.data) == 1 and fig.data[0].type == "heatmap"


def test_run_level_views_and_figures(tiny_run):
    from workbench.views import figures

    cv = tiny_run.code_view()
    per = tiny_run.code_view(per_token=True)
    assert per.height == tiny_run.tokens().height and per["end"][-1] == len(tiny_run.text)
    generated = per.filter(~pl.col("is_prompt") & pl.col("class").is_not_null())
    assert cv.columns[:2] == ["class", "tokens"] and cv["tokens"].sum() == generated.height > 0
    check = tiny_run.compile_check()
    assert check["status"] in ("ok", "incomplete", "error")
    if not check["ok"]:
        assert 0 <= check["pos"] < tiny_run.tokens().height
    decode = tiny_run.steps().filter(pl.col("kind") == "decode").height
    fit = tiny_run.latency_fit()  # ~11 decode steps on a tiny model: noisy, but a fit
    assert fit.n == decode >= 4 and 0 <= fit.b <= 8
    s = tiny_run.model_summary
    assert tiny_run.expert_cache([2], decode_only=True).filter(pl.col("layer").is_null())["lookups"][0] == (
        decode * s.top_k * len(s.moe_layers))
    for fig in (tiny_run.fig_expert_cache(), tiny_run.fig_code_view(), tiny_run.fig_latency_fit(),
                figures.latency_fit_figure(fit)):
        assert len(fig.data) >= 1
    assert len(tiny_run.fig_expert_cache().layout.shapes) == 2  # the seeds' 82.4% and 94.1%


def test_precision_probe_on_a_transformers_moe(tmp_path):
    pytest.importorskip("transformers")
    from workbench.capture.tiny import make_folder

    run = workbench.record("def add(a, b):", model=make_folder("mixtral", tmp_path / "mixtral"), max_new_tokens=6,
                           db=tmp_path / "wb.duckdb", detect=False)
    df = run.precision_probe(formats=["fp32", "int8"])
    assert df.filter(pl.col("format") == "fp32")["rel_l2"].to_list() == [0.0] * 3
    for part in ("weights", "activations", "kv"):  # fused expert stacks, their inputs, the cache's keys and values
        one = run.precision_probe(formats=["int8"], layers=[1], parts=(part,), all_layers=False)
        assert one["rel_l2"][0] > 0, part
