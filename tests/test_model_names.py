"""Bundled model names resolve in one place, for the CLI, `LLM` and the server alike."""

from __future__ import annotations

import pytest

from thinkspec.model_names import TOY_MODELS, resolve_model_name, toy_name

INSTALLED = all((path / "config.json").is_file() for path in TOY_MODELS.values())
needs_toy = pytest.mark.skipif(not INSTALLED, reason="the bundled toy checkpoints are not installed")


def test_resolve_model_name():
    assert resolve_model_name("/some/folder") == "/some/folder"
    assert resolve_model_name("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert len(TOY_MODELS) == 2
    for name, path in TOY_MODELS.items():
        if (path / "config.json").is_file():
            assert resolve_model_name(name) == str(path)
            assert toy_name(resolve_model_name(name)) == name
        else:
            with pytest.raises(ValueError, match=name):
                resolve_model_name(name)


def test_a_mistyped_bundled_name_gets_a_hint(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"model='toy-reasonr' .*did you mean 'toy-reasoner'\?") as info:
        resolve_model_name("toy-reasonr")
    assert "bundled: 'toy-reasoner', 'toy-reasoner-draft'" in str(info.value)
    wrong_draft = r"speculative_config.model='toy-reasoner-drft' .*did you mean 'toy-reasoner-draft'"
    with pytest.raises(ValueError, match=wrong_draft):
        resolve_model_name("toy-reasoner-drft", "speculative_config.model")
    with pytest.raises(ValueError, match=r"bundled: 'toy-reasoner'") as info:
        resolve_model_name("qwen3")  # no '/': not a hub id either
    assert "did you mean" not in str(info.value)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "toy-reasonr").mkdir()
    assert resolve_model_name("toy-reasonr") == "toy-reasonr"  # an existing folder wins


@needs_toy
def test_llm_takes_the_bundled_names():
    from thinkspec import LLM, SamplingParams

    spec = {"model": "toy-reasoner-draft", "num_speculative_tokens": 2}
    llm = LLM("toy-reasoner", speculative_config=spec, device="cpu", kv_cache_memory=2**22)
    assert llm.engine_args.model == str(TOY_MODELS["toy-reasoner"])
    assert llm.engine_args.speculative_config.model == str(TOY_MODELS["toy-reasoner-draft"])
    out = llm.generate(["1+2="], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 4


@needs_toy
def test_llm_names_the_argument_that_is_wrong(tmp_path):
    from thinkspec import LLM

    with pytest.raises(ValueError, match=r"model='toy-reasonr' .*did you mean 'toy-reasoner'"):
        LLM("toy-reasonr", device="cpu")
    spec = {"model": "toy-reasoner-drft", "num_speculative_tokens": 2}
    wrong_draft = r"speculative_config.model='toy-reasoner-drft' .*did you mean 'toy-reasoner-draft'"
    with pytest.raises(ValueError, match=wrong_draft):
        LLM("toy-reasoner", speculative_config=spec, device="cpu")
    spec = {"model": str(tmp_path / "missing"), "num_speculative_tokens": 2}
    with pytest.raises(FileNotFoundError, match=r"speculative_config.model: .*missing"):
        LLM("toy-reasoner", speculative_config=spec, device="cpu", kv_cache_memory=2**22)


@needs_toy
def test_server_resolves_the_bundled_names(capsys, monkeypatch):
    pytest.importorskip("fastapi")
    from thinkspec.entrypoints.cli import main
    from thinkspec.llm import LLM

    def no_llm(*args: object, **kwargs: object) -> None:
        raise AssertionError("the server builds its engine from EngineArgs, not through LLM")

    monkeypatch.setattr(LLM, "__init__", no_llm)

    assert main(["serve", "toy-reasonr", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "thinkspec serve: error:" in err and "did you mean 'toy-reasoner'" in err
    # The engine builds from the names (then the limit, above its max_model_len, stops the start).
    draft = '{"model": "toy-reasoner-draft", "num_speculative_tokens": 2}'
    argv = ["serve", "toy-reasoner", "--device", "cpu", "--kv-cache-memory", str(2**22),
            "--speculative-config", draft, "--max-tokens-limit", str(10**9)]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--max-tokens-limit 1000000000 exceeds max_model_len" in err
