"""Every model family through its adapter: tiny random ``transformers`` folders made here (tests/families.py).

For each MoE family (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss, DeepSeek-V2, DeepSeek-V3) the recorded
routing must equal the router module's own output, tokens and attention must equal transformers' own
forward, root cause must hold IG completeness and ablate heads, experts (by re-routing), shared experts and
routers as documented, and replay must reproduce the run; dense Llama, Qwen2 and Mistral record as dense.
"""
from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch

transformers = pytest.importorskip("transformers")

import workbench  # noqa: E402
from workbench import cli  # noqa: E402
from workbench.analysis import faults
from workbench.analysis.rootcause import integrated_gradients  # noqa: E402
from workbench.capture.adapters import HFAdapter, adapter_for, load_adapter  # noqa: E402
from workbench.capture.adapters.hf import load_hf  # noqa: E402
from workbench.capture.tiny import DENSE_FAMILIES, FAMILIES, MOE_FAMILIES, make_folder  # noqa: E402
from workbench.data import query

PROMPT = "def add(a, b):\n    return"
NEW = 5
SHARED = {"qwen2_moe": 1, "deepseek_v2": 1, "deepseek_v3": 1}
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    made: dict[str, Path] = {}
    runs: dict[str, workbench.Run] = {}
    store = workbench.Store(root / "w.duckdb")

    def folder(family: str) -> Path:
        if family not in made:
            made[family] = make_folder(family, root / family)
        return made[family]

    def run(family: str) -> workbench.Run:
        if family not in runs:  # DeepseekV3 through transformers here (the native load is tested below)
            with warnings.catch_warnings():
                warnings.simplefilter("error", UserWarning)  # a recognised model records without a warning
                runs[family] = workbench.record(PROMPT, model=folder(family), max_new_tokens=NEW, db=store,
                                                backend="transformers")
        return runs[family]

    return {"folder": folder, "run": run, "store": store, "root": root}


def reference(folder: Path, seq: list[int]):
    """transformers' own forward of ``seq``: logits, attentions, and per MoE layer the router's output
    (logits, weights, indices) and what the experts module received (indices, weights)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager").eval()
    routers, received, handles = {}, {}, []
    for i, layer in enumerate(hf.model.layers):
        block = getattr(layer, "mlp", None)
        router = getattr(block, "gate", None) if not hasattr(block, "router") else block.router
        if router is None or not hasattr(block, "experts") or not type(router).__name__.endswith("Router"):
            continue
        handles.append(router.register_forward_hook(lambda m, a, o, i=i: routers.__setitem__(i, o)))
        handles.append(block.experts.register_forward_pre_hook(
            lambda m, a, i=i: received.__setitem__(i, (a[1], a[2]))))
    with torch.no_grad():
        out = hf(torch.tensor([seq]), output_attentions=True)
    for h in handles:
        h.remove()
    return hf, out, routers, received


def by_expert(idx: torch.Tensor, w: torch.Tensor, n: int) -> np.ndarray:
    return torch.zeros(idx.size(0), n).scatter_add_(1, idx.long(), w.float()).numpy()


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_routing_is_the_routers_own_selection(env, family):
    run = env["run"](family)
    s = run.model_summary
    assert s.family == family and s.backend == "transformers" and not s.notes and not s.unrouted_layers
    assert (s.n_routed_experts, s.top_k, s.n_shared_experts) == (8, 2, SHARED.get(family, 0))
    assert s.moe_layers == ([1] if family == "deepseek_v3" else [0, 1])  # DeepSeek-V3: first_k_dense_replace=1
    assert s.selection_bias == (family == "deepseek_v3")
    assert "dense" not in s.describe() and "MoE in" in s.describe()
    seq = run.tokens()["token_id"].to_list()
    n = len(seq) - 1  # the last token is produced, never fed
    hf, _, routers, received = reference(env["folder"](family), seq[:-1])
    rt = run.routing()
    assert sorted(rt["layer"].unique().to_list()) == s.moe_layers
    for layer in s.moe_layers:
        logits, w_ref, idx_ref = routers[layer]
        got_idx, got_w = received[layer]
        assert torch.equal(got_idx, idx_ref) and torch.equal(got_w, w_ref)  # experts get the router's output
        got = rt.filter(pl.col("layer") == layer).sort("pos", "slot")
        assert got.height == n * 2
        exp = torch.tensor(got["expert"].to_numpy().reshape(n, 2))
        w = torch.tensor(got["weight"].to_numpy().reshape(n, 2))
        np.testing.assert_allclose(by_expert(exp, w, 8), by_expert(idx_ref, w_ref, 8), atol=1e-4)
        assert (np.diff(w.numpy(), axis=1) <= 1e-12).all()  # slots by decreasing weight
        assert len(set(exp.flatten().tolist())) >= 3  # routing depends on the input
        # raw score: sigmoid (DeepSeek-V3) or softmax of the router logits; margin over the selection basis
        lg = logits.float()
        scores = lg.sigmoid() if family == "deepseek_v3" else lg.softmax(-1)
        np.testing.assert_allclose(got["score"].to_numpy().reshape(n, 2), scores.gather(1, exp).numpy(), atol=1e-4)
        basis = scores  # gpt-oss's softmax over its top-k logits is this same rule
        if family == "deepseek_v3":
            basis = basis + hf.model.layers[layer].mlp.gate.e_score_correction_bias
        chosen = torch.zeros_like(basis, dtype=torch.bool).scatter_(1, idx_ref, True)
        margin = basis.masked_fill(~chosen, float("inf")).amin(-1) - basis.masked_fill(chosen, float("-inf")).amax(-1)
        np.testing.assert_allclose(got.filter(pl.col("slot") == 0)["margin"].to_numpy(), margin.numpy(), atol=1e-4)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tokens_and_attention_equal_transformers(env, family):
    run = env["run"](family)
    assert run.status == "complete"
    tok = run.tokens()
    assert tok.filter(pl.col("is_prompt"))["text"].str.join("").item() == PROMPT  # the folder's tokenizer
    seq = tok["token_id"].to_list()
    n = len(seq) - 1
    _, out, _, _ = reference(env["folder"](family), seq)
    p = out.logits[0, :-1].float().softmax(-1)
    nxt = torch.tensor(seq[1:])
    np.testing.assert_allclose(tok["prob"].to_numpy()[1:], p.gather(1, nxt[:, None])[:, 0].numpy(), rtol=1e-3,
                               atol=1e-6)
    np.testing.assert_allclose(tok["entropy"].to_numpy()[1:], (-torch.special.xlogy(p, p).sum(-1)).numpy(), atol=1e-3)
    assert tok.filter(~pl.col("is_prompt"))["rank"].to_list() == [1] * NEW  # greedy
    att = run.attention()
    for layer, a in enumerate(out.attentions):
        probs = a[0, :, :n, :n].float()  # [H, T, T]
        got = att.filter(pl.col("layer") == layer).sort("pos", "head")
        assert got.height == n * probs.size(0)
        for col, ref in (("entropy", -torch.special.xlogy(probs, probs).sum(-1)), ("max_weight", probs.amax(-1)),
                         ("sink_weight", probs[..., 0])):
            np.testing.assert_allclose(got[col].to_numpy(), ref.T.ravel().numpy(), atol=1e-4, err_msg=col)
        ne = got.filter(pl.col("pos") > 0)["norm_entropy"].to_numpy()
        assert np.nanmax(ne) <= 1 + 1e-6  # normalised by the keys each query could see (sliding windows too)
    kv = run.kv()
    assert kv.height and (kv["bytes"] > 0).all()
    assert run.steps()["kind"].to_list() == ["prefill"] + ["decode"] * (NEW - 1)
    assert run.resid_norm().height == len(seq[:-1]) * run.model_summary.n_layers


@pytest.mark.parametrize("family", DENSE_FAMILIES)
def test_dense_families_are_recorded_as_dense(env, family):
    run = env["run"](family)
    s = run.model_summary
    assert run.routing().height == 0 and s.moe_layers == [] and s.unrouted_layers == [] and not s.notes
    assert s.describe().endswith("dense") and run.info["notes"] is None
    assert "dense model" in query.no_routing_reason(env["store"], run.run_id)
    assert {k for k, *_ in run.adapter().components()} == {"head"}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_root_cause_and_replay_on_every_family(env, family):
    run = env["run"](family)
    s = run.model_summary
    pos = run.info["n_prompt_tokens"] + 2
    df = run.root_cause(pos, steps=32)
    kinds = set(df["kind"])
    want = {"token", "head"} | ({"expert"} if s.moe_layers else set()) \
        | ({"shared_expert"} if s.n_shared_experts else set()) | ({"router"} if s.selection_bias else set())
    want |= {"embed", "unembed"}  # the weight rows root cause adds without a reference (rootcause.row_evidence)
    assert kinds == want
    ig = df.filter(pl.col("kind") == "token")
    total, delta = float(ig["score"].sum()), float(ig["delta"][0])
    assert abs(delta) <= 0.01 * abs(total - delta), (total, delta)  # completeness within 1% (routing frozen)
    assert run.replay()["match"]


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_ablations_do_what_they_say(env, family):
    """Head: zero its slice of o_proj's input; routed expert: removed from the choice (re-routed); shared
    expert: its output zeroed; router: its selection bias removed. Each equals a hand-made intervention."""
    from workbench.analysis.rootcause import component_ablation, target_fn

    run = env["run"](family)
    a = run.adapter()
    hf = a.module
    ids = torch.tensor([run.tokens()["token_id"].to_list()[: run.info["n_prompt_tokens"] + 1]])
    target = int(run.tokens()["token_id"][run.info["n_prompt_tokens"] + 1])
    comps, eff = component_ablation(a, ids, target, batch_size=8)
    effect = dict(zip(comps, eff))
    f = target_fn(a, target)
    with torch.no_grad():
        base = float(f(ids)[0])
    layer = a.summary.moe_layers[-1]
    attn = hf.model.layers[layer].self_attn
    hd = attn.o_proj.in_features // a.summary.n_heads

    def zero_head(m, args):
        x = args[0].clone()
        x[..., hd:2 * hd] = 0  # head 1
        return (x,)
    with torch.no_grad():
        h = attn.o_proj.register_forward_pre_hook(zero_head)
        manual = base - float(f(ids)[0])
        h.remove()
    assert effect[("head", layer, 1, None)] == pytest.approx(manual, abs=1e-5)
    # a routed expert removed: the router never picks it, its tokens go to the next best expert
    expert = int(run.routing().filter(pl.col("layer") == layer)["expert"][0])
    block = hf.model.layers[layer].mlp
    seen = []
    with torch.no_grad(), a.seams({"route": lambda i, r: None if i != layer else r.remove(
            torch.arange(8)[None].ne(expert).expand_as(r.logits))}):
        rec = block.experts.register_forward_pre_hook(lambda m, args: seen.append(args[1].clone()))  # runs after
        removed = base - float(f(ids)[0])
    rec.remove()
    assert not (seen[-1] == expert).any()
    assert effect[("expert", layer, None, expert)] == pytest.approx(removed, abs=1e-5)
    if a.summary.n_shared_experts:
        shared = getattr(block, "shared_experts", None) or block.shared_expert
        with torch.no_grad():
            h = shared.register_forward_hook(lambda m, args, out: out * 0)
            manual = base - float(f(ids)[0])
            h.remove()
        assert effect[("shared_expert", layer, None, None)] == pytest.approx(manual, abs=1e-5)
    if a.summary.selection_bias:
        bias = block.gate.e_score_correction_bias
        saved = bias.clone()
        with torch.no_grad():
            bias.zero_()
            manual = base - float(f(ids)[0])
            bias.copy_(saved)
        assert effect[("router", layer, None, None)] == pytest.approx(manual, abs=1e-5)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "deepseek_v3"])
def test_faults_on_transformers_models(env, family):
    run = env["run"](family)
    a = run.adapter()
    layer = a.summary.moe_layers[-1]
    ids = [int(i) for i in run.tokens()["token_id"].to_list()[: run.info["n_prompt_tokens"]]]
    with faults.bias_router(a, layer, 5, amount=50.0):
        biased = workbench.record(ids, model=a, max_new_tokens=2, db=env["store"], detect=False)
    r = biased.routing().filter(pl.col("layer") == layer)
    assert (r.group_by("pos").agg((pl.col("expert") == 5).any())["expert"]).all()  # every token goes to 5
    with faults.break_expert(a, layer, 5, scale=30.0), faults.bias_router(a, layer, 5, amount=50.0):  # they compose
        broken = workbench.record(ids, model=a, max_new_tokens=2, db=env["store"], detect=False)
    assert not np.allclose(broken.tokens()["logprob"].to_numpy()[1:], biased.tokens()["logprob"].to_numpy()[1:])
    with faults.break_head(a, 0, 1, scale=30.0):
        head = workbench.record(ids, model=a, max_new_tokens=2, db=env["store"], detect=False)
    assert not np.allclose(head.tokens()["logprob"].to_numpy()[1:], biased.tokens()["logprob"].to_numpy()[1:])
    x = torch.tensor([ids])
    with torch.no_grad():
        base = a.forward(x)[0]
        with faults.inject_nan(a, 0, 3):  # through the adapter: the stream after block 0 is NaN from position 3
            nan = a.forward(x)[0]
        with faults.corrupt_kv(a, 0, 2):  # the entry cached for position 2: queries from 2 on see it
            kv = a.forward(x)[0]
    # (eager attention multiplies masked weights by the NaN values too, so earlier rows of a full forward go NaN)
    assert torch.isfinite(base).all() and torch.isnan(nan[3]).all()
    assert torch.allclose(kv[:2], base[:2], atol=1e-5) and not torch.allclose(kv[2:], base[2:], atol=1e-3)
    clean = workbench.record(ids, model=a, max_new_tokens=2, db=env["store"], detect=False)  # faults undone
    np.testing.assert_allclose(clean.tokens()["logprob"].to_numpy()[1:], run.tokens()["logprob"].to_numpy()[1:len(ids) + 2],
                               atol=1e-5)


def test_deepseek_v3_through_transformers_equals_the_native_load(env):
    folder = env["folder"]("deepseek_v3")
    hf_run = env["run"]("deepseek_v3")
    native = workbench.record(PROMPT, model=folder, max_new_tokens=NEW, db=env["store"])  # auto: native
    assert native.model_summary.backend == "native" and hf_run.model_summary.backend == "transformers"
    assert native.tokens()["token_id"].to_list() == hf_run.tokens()["token_id"].to_list()
    np.testing.assert_allclose(native.tokens()["logprob"].to_numpy()[1:], hf_run.tokens()["logprob"].to_numpy()[1:],
                               atol=1e-4)
    for table, cols in (("attention", ["entropy", "max_weight", "sink_weight"]),
                        ("routing", ["weight", "score", "margin"]), ("resid_norm", ["norm"])):
        a, b = native.signal(table), hf_run.signal(table)
        assert a.height == b.height > 0
        if table == "routing":
            assert a["expert"].to_list() == b["expert"].to_list()
        for c in cols:
            np.testing.assert_allclose(a[c].to_numpy(), b[c].to_numpy(), atol=2e-4, rtol=1e-4, err_msg=f"{table}.{c}")
    keep = {k for k in native.model_summary.to_dict() if k not in ("backend", "n_kv_heads")}
    assert {k: native.model_summary.to_dict()[k] for k in keep} == {k: hf_run.model_summary.to_dict()[k] for k in keep}


@pytest.mark.parametrize("family", [*MOE_FAMILIES, "llama"])
def test_cli_records_explains_and_replays(env, family, capsys):
    """``workbench record --model FOLDER --json`` (run_id last), ``workbench explain RUN POS``, ``workbench replay
    RUN`` on every family."""
    folder, db = env["folder"](family), str(env["root"] / "cli.duckdb")
    assert cli.main(["record", "--model", str(folder), "--prompt", PROMPT, "--max-new-tokens", "4", "--json",
                     "--db", db]) == 0
    rid = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["run_id"]
    run = workbench.open(db).run(rid)
    assert (run.routing().height > 0) == (family != "llama")
    assert cli.main(["explain", rid, "8", "--steps", "8", "--json", "--db", db]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"token", "head"} <= {c["kind"] for c in out["causes"]}
    assert ("expert" in {c["kind"] for c in out["causes"]}) == (family != "llama")
    assert cli.main(["replay", rid, "--json", "--db", db]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["match"] is True


def test_report_of_a_transformers_moe_run(env, tmp_path):
    run = env["run"]("qwen2_moe")
    facts = json.loads(Path(run.report(tmp_path / "r.json", "json")).read_text())
    assert facts["model"]["family"] == "qwen2_moe" and facts["model"]["moe_layers"] == [0, 1]
    assert len(facts["signals"]["expert_load"]) > 0
    html = Path(run.report(tmp_path / "r.html", "html")).read_text()
    assert "qwen2_moe, 2 layers x 4 heads, MoE in 2 layers: 8 experts top-2 + 1 shared" in html


def test_llama_chunked_prefill_and_kv_rows(env):
    folder = env["folder"]("llama")
    run = env["run"]("llama")
    chunked = load_hf(folder, attn_chunk=3)
    assert isinstance(chunked, HFAdapter)
    run2 = workbench.record(PROMPT, model=chunked, max_new_tokens=NEW, db=env["store"])
    np.testing.assert_allclose(run2.attention()["entropy"].to_numpy(), run.attention()["entropy"].to_numpy(), atol=1e-5)
    assert run2.tokens()["token_id"].to_list() == run.tokens()["token_id"].to_list()
    kv = run.kv()  # keys + values from transformers' cache: 2 kv heads x 16 dims, fp32
    assert (kv["bytes"] == kv["cached_tokens"] * 2 * 2 * 16 * 4).all()
    kt = run.kv_tokens()
    final = kt.filter(pl.col("step") == kt["step"].max())
    n_rows = run.tokens().height - 1
    for layer in (0, 1):
        assert final.filter(pl.col("layer") == layer)["attn_received"].sum() == pytest.approx(n_rows * 4, rel=1e-5)


class CustomMoE(torch.nn.Module):
    """An MoE block in no adapter's convention: a Linear gate and a ModuleList of experts, top-1."""

    def __init__(self, dim: int, n: int = 4):
        super().__init__()
        self.gate = torch.nn.Linear(dim, n, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(dim, dim, bias=False) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.gate(x).argmax(-1)
        return torch.stack([e(x) for e in self.experts], -2).gather(
            -2, choice[..., None, None].expand(*x.shape[:-1], 1, x.size(-1)))[..., 0, :]


def test_unrecognised_moe_blocks_are_said_never_dense(env):
    folder = env["folder"]("llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager").eval()
    hf.model.layers[1].mlp = CustomMoE(hf.config.hidden_size)
    with pytest.warns(UserWarning, match="no adapter recognises"):
        run = workbench.record(PROMPT, model=hf, tokenizer=folder / "tokenizer.json", max_new_tokens=3,
                               db=env["store"])
    s = run.model_summary
    assert s.unrouted_layers == [1] and s.moe_layers == [] and "no adapter recognises" in run.info["notes"]
    assert "dense" not in s.describe() and "unrecognised" in s.describe()
    reason = query.no_routing_reason(env["store"], run.run_id)
    assert "dense" not in reason and "[1]" in reason
    assert run.routing().height == 0 and run.attention().height > 0
    assert "dense" not in run.fig_expert_load().layout.annotations[0].text


def test_a_folder_without_a_tokenizer_says_what_is_missing(env, tmp_path, capsys):
    folder = make_folder("mixtral", tmp_path / "bare", tokenizer=False)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        workbench.record(PROMPT, model=folder, max_new_tokens=2, db=env["store"])
    tok = env["folder"]("mixtral") / "tokenizer.json"
    assert workbench.record(PROMPT, model=folder, tokenizer=tok, max_new_tokens=2, db=env["store"]).status == "complete"
    db = str(tmp_path / "t.duckdb")
    assert cli.main(["record", "--model", str(folder), "--prompt", PROMPT, "--max-new-tokens", "2", "--db", db]) == 2
    assert "tokenizer.json" in capsys.readouterr().err
    assert cli.main(["record", "--model", str(folder), "--tokenizer", str(tok), "--prompt", PROMPT,
                     "--max-new-tokens", "2", "--json", "--db", db]) == 0


def test_adapter_for_modules_and_the_router_rule_check(env):
    folder = env["folder"]("qwen3_moe")
    a = load_adapter(folder)
    assert adapter_for(a.module) is a  # one adapter per module
    math = a.router(0)
    h = torch.randn(16, 64)
    logits, w, idx = a.moe[0][1](h)
    assert math.matches(logits, idx, w)
    assert not math.matches(logits, idx.flip(0), w)  # the check can fail
    with pytest.raises(TypeError, match="cannot record"):
        adapter_for(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="native"):
        load_adapter(folder, backend="native")


def test_workbench_imports_beside_a_users_own_model_probes_and_apps(tmp_path):
    """From a folder holding its own model.py, probes.py and apps/ package, import workbench and record."""
    for name in ("model.py", "probes.py"):
        (tmp_path / name).write_text("raise ImportError('the user module was imported instead of ours')\n")
    (tmp_path / "apps").mkdir()
    (tmp_path / "apps" / "__init__.py").write_text("raise ImportError('the user package was imported')\n")
    code = ("import workbench, model\n"  # the user's own modules still import as theirs... (model raises)\n"
            if False else
            "import sys; sys.path.insert(0, '')\n"
            "import workbench\n"
            "r = workbench.record([1, 2, 3], max_new_tokens=2, db='w.duckdb', detect=False)\n"
            "print(r.status, r.tokens().height)\n"
            "from workbench.apps.app import build_app\n"
            "import importlib.util; assert importlib.util.find_spec('model').origin.endswith('model.py')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={"GRADIO_ANALYTICS_ENABLED": "False", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["complete", "5"]


def test_device_mapped_folder_records_like_a_plain_load(tmp_path):
    """A transformers folder placed with an accelerate device map records through the same adapter: here the
    blocks are mapped by name, one of them offloaded to disk (accelerate's dispatch hooks load it for each
    forward, as they move activations between GPUs), and tokens, routing and attention equal the plain load's;
    the CLI takes --device-map as JSON."""
    pytest.importorskip("accelerate")
    folder = make_folder("mixtral", tmp_path / "mixtral")
    store = workbench.Store(tmp_path / "w.duckdb")
    plain = workbench.record([3, 5, 7, 9], model=str(folder), max_new_tokens=6, db=store, detect=False)
    n_layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    dmap = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu",
            **{f"model.layers.{i}": "cpu" for i in range(n_layers)}, "model.layers.1": "disk"}
    mapped = workbench.record([3, 5, 7, 9], model=str(folder), max_new_tokens=6, db=store, detect=False,
                              device_map=dmap)
    assert mapped.model().hf_device_map["model.layers.1"] == "disk"
    assert mapped.tokens()["token_id"].to_list() == plain.tokens()["token_id"].to_list()
    for table, cols in (("routing", ["expert", "weight"]), ("attention", ["entropy"]), ("tokens", ["logprob"])):
        a, b = mapped.signal(table), plain.signal(table)
        assert a.height == b.height > 0
        for c in cols:
            np.testing.assert_allclose(a[c].to_numpy().astype(float), b[c].to_numpy().astype(float), rtol=1e-5,
                                       atol=1e-6, equal_nan=True)
    from workbench.cli import main
    assert main(["record", "--model", str(folder), "--prompt", "def f(x):", "--max-new-tokens", "3",
                 "--device-map", json.dumps(dmap), "--db", str(tmp_path / "cli.duckdb"), "--json"]) == 0
    with pytest.raises(ValueError, match="device_map"):
        workbench.record([3, 5], model=str(folder), max_new_tokens=2, db=store, device_map="cpu", backend="native")


def test_an_in_memory_module_with_fused_attention_is_switched_to_eager(tmp_path):
    """A transformers module loaded with the default SDPA attention hands out no probabilities: the adapter
    says so and switches it to eager, so its attention rows are recorded (not silently none)."""
    from transformers import AutoModelForCausalLM

    folder = make_folder("mixtral", tmp_path / "mixtral")
    hf = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="sdpa", dtype=torch.float32)
    with pytest.warns(UserWarning, match="eager"):
        run = workbench.record([3, 5, 7], model=hf, tokenizer=str(folder / "tokenizer.json"), max_new_tokens=3,
                               db=workbench.Store(tmp_path / "w.duckdb"), detect=False)
    n_layers, n_heads = run.model_summary.n_layers, run.model_summary.n_heads
    assert run.attention().height == 5 * n_layers * n_heads  # positions 0..4 fed x layers x heads


# -- what-ifs ask the adapter (blocks, quantization points, teacher forcing, the KV cache's writes) -------------

@pytest.mark.parametrize("family", ["native", "mixtral", "qwen2_moe", "gpt_oss", "deepseek_v3", "llama"])
def test_what_if_extension_points_on_native_and_transformers_models(env, family):
    from helpers import tiny_model

    from workbench.analysis.precision import precision_probe

    adapter = adapter_for(tiny_model(vocab_size=300)) if family == "native" else \
        load_adapter(env["folder"](family), backend="transformers")
    s = adapter.summary
    blocks = adapter.blocks()
    assert len(blocks) == s.n_layers
    ids = torch.tensor([[3, 5, 7, 9, 11, 13]])
    with adapter.analysis(), torch.no_grad():
        plain = adapter.forward(ids).float()
    before = [getattr(getattr(b, "attn", None), "cache", None) for b in blocks]
    with adapter.teacher_forcing(ids.size(1)) as forward:
        got = forward(ids)
        with adapter.quantize_kv(s.n_layers - 1, lambda t: t):
            assert torch.equal(forward(ids), got)  # the identity on the cache's writes changes nothing
        with adapter.quantize_kv(s.n_layers - 1, torch.zeros_like):
            zeroed = forward(ids)
        assert torch.equal(forward(ids), got)  # and is gone on exit
    assert not torch.equal(zeroed, got) and zeroed.shape == got.shape
    torch.testing.assert_close(got, plain, rtol=1e-4, atol=1e-4)  # a cached full forward is the plain forward
    assert [getattr(getattr(b, "attn", None), "cache", None) for b in blocks] == before  # the generation's cache back
    for i in range(s.n_layers):
        pts = adapter.quantization_points(i)
        assert pts.block is blocks[i]
        params = {id(p) for p in blocks[i].parameters()}
        if i in s.moe_layers:  # the router, inside the block, is what stays in full precision
            assert len(pts.full_precision) == 1
            assert {id(p) for p in pts.full_precision[0].parameters()} <= params
            assert pts.full_precision[0].weight.shape[0] == s.n_routed_experts  # the router's [E, D] weight
        else:
            assert pts.full_precision == []
        for m in pts.fused_experts:  # stacked 3-D expert weights, no nn.Linear inside
            assert not any(isinstance(x, torch.nn.Linear) for x in m.modules())
            assert any(p.ndim == 3 for p in m.parameters())
    # the precision probe through these points: the fp32 control changes nothing, int8 on the KV cache does
    df = precision_probe(adapter, ids[0].tolist(), formats=["fp32", "int8"], parts=("kv",), all_layers=False)
    fp32, int8 = df.filter(pl.col("format") == "fp32"), df.filter(pl.col("format") == "int8")
    assert fp32["rel_l2"].to_list() == [0.0] * s.n_layers and fp32["top1_agreement"].to_list() == [1.0] * s.n_layers
    assert max(int8["rel_l2"].to_list()) > 0
