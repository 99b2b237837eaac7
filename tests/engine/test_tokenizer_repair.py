"""Tokenizers as transformers 5.17 converts a byte-level BPE GGUF file (seen on a GPU machine's
image): sentencepiece decoder steps ahead of the ByteLevel one, and the BOS token as
eos_token. llguidance reads each token's bytes off the decoder chain, so with that chain
structured outputs refuse the tokens that spell a choice. Reproduced on the tokenizer of the
transformers installed here; loading through load_tokenizer repairs both."""

import json

from tokenizers import decoders

from contbatch.engine import tokenizer as tokenizer_module
from contbatch.engine.tokenizer import load_tokenizer
from contbatch.structured_outputs import StructuredOutputsParams

EOS_ID, BOS_ID, VOCAB_SIZE = 2, 1, 49152
CHOICE = StructuredOutputsParams(choice=["yes, it is", "no (never)"])


def _as_transformers_5_17_converts_it(tokenizer):
    tokenizer.backend_tokenizer.decoder = decoders.Sequence([
        decoders.ByteFallback(), decoders.Fuse(), decoders.Replace("\u2581", " "),
        decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)])
    tokenizer.eos_token = "<|im_start|>"
    return tokenizer


def _decoder_type(tokenizer) -> str:
    return json.loads(tokenizer.backend_tokenizer.decoder.__getstate__())["type"]


def _accepts(tokenizer, text: str) -> bool:
    """Whether a choice grammar compiled for ``tokenizer`` takes ``text``'s tokens, then EOS."""
    from contbatch.structured_outputs.grammar import GrammarCompiler  # imports torch._dynamo: ~1.5 s

    matcher = GrammarCompiler(tokenizer, VOCAB_SIZE, frozenset({EOS_ID})).matcher(CHOICE)
    try:
        for token_id in tokenizer.encode(text) + [EOS_ID]:
            matcher.accept(token_id)
    except ValueError:
        return False
    return matcher.is_finished


def test_a_gguf_files_tokenizer_gets_the_bytelevel_decoder_and_the_files_eos(smollm_gguf, monkeypatch):
    real = tokenizer_module.AutoTokenizer.from_pretrained
    faulty = _as_transformers_5_17_converts_it(real(str(smollm_gguf.parent), gguf_file=smollm_gguf.name))
    monkeypatch.setattr(tokenizer_module.AutoTokenizer, "from_pretrained",
                        lambda *args, **kwargs: _as_transformers_5_17_converts_it(real(*args, **kwargs)))
    repaired = load_tokenizer(smollm_gguf)

    assert (faulty.eos_token_id, repaired.eos_token_id) == (BOS_ID, EOS_ID)
    assert (_decoder_type(faulty), _decoder_type(repaired)) == ("Sequence", "ByteLevel")
    assert not _accepts(faulty, "yes, it is")
    assert _accepts(repaired, "yes, it is") and _accepts(repaired, "no (never)")
    assert repaired.decode(repaired.encode("café, ▁ <0x41>")) == "café, ▁ <0x41>"


def test_a_directory_converted_by_transformers_5_17_gets_the_bytelevel_decoder(smollm_dir, tmp_path):
    real = tokenizer_module.AutoTokenizer.from_pretrained(smollm_dir)
    _as_transformers_5_17_converts_it(real).save_pretrained(tmp_path)
    repaired = load_tokenizer(tmp_path)
    assert _decoder_type(repaired) == "ByteLevel"
    assert _accepts(repaired, "no (never)")


def test_other_decoder_chains_are_left_alone(smollm_dir, tmp_path):
    tokenizer = tokenizer_module.AutoTokenizer.from_pretrained(smollm_dir)
    chain = decoders.Sequence([decoders.Fuse(), decoders.ByteLevel()])
    tokenizer.backend_tokenizer.decoder = chain
    tokenizer.save_pretrained(tmp_path)
    assert load_tokenizer(tmp_path).backend_tokenizer.decoder.__getstate__() == chain.__getstate__()
