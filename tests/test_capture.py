"""Hooks on any module (issue 27, point 4): ``attach`` and ``hook_points`` on a transformers model's plain module
paths, and ``workbench.capture`` (the named outputs of one forward, no store) against plain forward hooks, with
its memory cap."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import tiny_model

import workbench
from workbench.capture.adapters import load_adapter
from workbench.capture.cache import CaptureTooLarge
from workbench.capture.tiny import make_folder
from workbench.probes import attach, hook_points

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = [5, 17, 42, 7, 99, 3, 11]


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory, one_thread):
    folder = make_folder("mixtral", tmp_path_factory.mktemp("cap") / "mixtral")
    return folder, load_adapter(folder)


def plain_hooks(module: torch.nn.Module, names: list[str], ids: list[int], **kw) -> dict[str, torch.Tensor]:
    """What register_forward_hook sees on each named module in one forward (first tensor of a tuple)."""
    mods = dict(module.named_modules())
    got = {}

    def keep(_m, _a, out, n):
        got.setdefault(n, (out[0] if isinstance(out, tuple) else out).detach().clone())  # returns None: observes

    handles = [mods[n].register_forward_hook(lambda m, a, out, n=n: keep(m, a, out, n)) for n in names]
    try:
        with torch.no_grad():
            module(torch.tensor([ids]), **kw)
    finally:
        for h in handles:
            h.remove()
    return got


def no_hooks_left(module: torch.nn.Module) -> bool:
    return not any(m._forward_hooks or m._forward_pre_hooks or getattr(m, "taps", None) for m in module.modules())


def test_capture_equals_plain_forward_hooks_on_a_transformers_model(mixtral):
    _, adapter = mixtral
    hf = adapter.module
    got = workbench.capture(hf, IDS, ["model.layers.*.mlp", "model.layers.1.self_attn", "model.norm"])
    names = ["model.layers.0.mlp", "model.layers.1.mlp", "model.layers.1.self_attn", "model.norm"]
    assert sorted(got) == sorted(names)
    want = plain_hooks(hf, names, IDS, use_cache=False)
    for n in names:
        assert torch.equal(got[n], want[n]), n
        assert not got[n].requires_grad
    assert got["model.layers.0.mlp"].shape == (1, len(IDS), 64)
    assert no_hooks_left(hf)


def test_capture_equals_plain_forward_hooks_on_our_model():
    model = tiny_model()
    got = workbench.capture(model, torch.tensor(IDS), ["layers.*.ffn", "layers.0.hook_resid_post", "layers.1.attn"])
    names = ["layers.0.ffn", "layers.1.ffn", "layers.0.hook_resid_post", "layers.1.attn"]
    assert sorted(got) == sorted(names)
    want = plain_hooks(model, names, IDS)
    for n in names:
        assert torch.equal(got[n], want[n]), n
    # the residual stream after block 0 is the block's own output
    assert torch.equal(got["layers.0.hook_resid_post"], plain_hooks(model, ["layers.0"], IDS)["layers.0"])
    assert no_hooks_left(model)


def test_capture_takes_a_folder_an_adapter_and_text(mixtral):
    folder, adapter = mixtral
    tok = workbench.model.load_tokenizer(folder / "tokenizer.json")
    text = "def add(a, b):"
    n = len(tok.encode(text).ids)
    from_folder = workbench.capture(str(folder), text, "model.layers.0.mlp")
    from_adapter = workbench.capture(adapter, tok.encode(text).ids, "model.layers.0.mlp")
    assert from_folder["model.layers.0.mlp"].shape == (1, n, 64)
    torch.testing.assert_close(from_folder["model.layers.0.mlp"], from_adapter["model.layers.0.mlp"])
    with pytest.raises(KeyError, match="no hook point or module path"):
        workbench.capture(adapter, IDS, "model.layers.9.*")


def test_the_memory_cap_refuses_in_one_line(mixtral):
    _, adapter = mixtral
    per_layer = len(IDS) * 64 * 4  # one [1, T, 64] fp32 output
    got = workbench.capture(adapter, IDS, "model.layers.*.mlp", max_bytes=2 * per_layer)  # exactly fits
    assert len(got) == 2
    with pytest.raises(CaptureTooLarge) as e:
        workbench.capture(adapter, IDS, "model.layers.*.mlp", max_bytes=2 * per_layer - 1)
    msg = str(e.value)
    assert "\n" not in msg and f"{2 * per_layer:,} bytes" in msg and f"max_bytes={2 * per_layer - 1:,}" in msg
    assert isinstance(e.value, MemoryError)
    assert no_hooks_left(adapter.module)  # the refused forward left no hook behind


def test_attach_on_a_plain_module_path_of_a_transformers_model(mixtral):
    _, adapter = mixtral
    hf = adapter.module
    ids = torch.tensor([IDS])
    with torch.no_grad():
        base = hf(ids, use_cache=False).logits
    seen = []
    mlp = dict(hf.named_modules())["model.layers.1.mlp"]

    def zero(out, name):
        seen.append((name, tuple(out.shape)))
        return torch.zeros_like(out)  # an intervention: the MoE block's output removed

    with torch.no_grad(), attach(hf, {"model.layers.1.mlp": zero}):
        assert mlp._forward_hooks
        edited = hf(ids, use_cache=False).logits
    assert seen == [("model.layers.1.mlp", (1, len(IDS), 64))]
    assert not torch.allclose(edited, base)
    assert not mlp._forward_hooks and no_hooks_left(hf)  # removed on exit
    with torch.no_grad():
        assert torch.equal(hf(ids, use_cache=False).logits, base)
    # a glob over plain paths; observing (None) changes nothing; an exception inside still removes the hooks
    observe = {"model.layers.*.self_attn": lambda o, **_: None}
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad(), attach(hf, observe):
        assert torch.equal(hf(ids, use_cache=False).logits, base)
        raise RuntimeError("boom")
    assert no_hooks_left(hf)
    with pytest.raises(KeyError, match="matches"), attach(hf, {"model.nothing.*": lambda o, **_: None}):
        pass


def test_hook_points_lists_a_transformers_models_module_paths(mixtral):
    hf = mixtral[1].module
    names = hook_points(hf)
    assert names and {"model.layers.0.mlp", "model.layers.1.self_attn", "model.norm", "lm_head"} <= set(names)
    assert set(hook_points(hf, "model.layers.*.mlp")) == {"model.layers.0.mlp", "model.layers.1.mlp"}
    # our model keeps listing its hook points only, unless every module is asked for
    ours = tiny_model()
    assert all(n.rsplit(".", 1)[-1].startswith("hook_") for n in hook_points(ours))
    assert "layers.0.ffn" in hook_points(ours, modules=True) and "layers.0.ffn" not in hook_points(ours)


def test_workbench_capture_is_callable_and_import_stays_torch_free():
    code = ("import sys, workbench\nassert callable(workbench.capture)\nimport workbench.capture.settings\n"
            "assert 'torch' not in sys.modules, 'torch'\nprint('ok')")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0 and got.stdout.strip() == "ok", got.stderr
