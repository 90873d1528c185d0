"""Tokenizer behaviour on the real SmolLM2 vocabulary: special tokens, chat template, streaming text."""

from __future__ import annotations

from hkserve.engine.detokenize import IncrementalDetokenizer

SAMPLES = ["Hello 🌍! 你好, naïve café — ok?", "emoji 👩‍👩‍👧 family", "  spaces\n\tand tabs  ", "1234567890"]


def test_control_tokens_are_single_ids_and_skipped_when_decoding(smollm2):
    tokenizer = smollm2[2]
    assert tokenizer.encode("<|im_start|>user")[0] == 1
    assert tokenizer.stop_ids == (2,)
    ids = tokenizer.encode("<|im_start|>hi<|im_end|>")
    assert tokenizer.decode(ids) == "hi"
    assert tokenizer.decode(ids, skip_special=False) == "<|im_start|>hi<|im_end|>"


def test_chat_template_uses_system_message_when_given(smollm2):
    tokenizer = smollm2[2]
    text = tokenizer.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_incremental_detokenization_is_utf8_safe_and_lossless(smollm2):
    tokenizer = smollm2[2]
    for text in SAMPLES:
        ids = tokenizer.encode(text)
        detok = IncrementalDetokenizer(tokenizer)
        deltas = [detok.add(i) for i in ids]
        deltas.append(detok.flush())
        assert all("\ufffd" not in d for d in deltas), deltas
        assert "".join(deltas) == tokenizer.decode(ids) == text
    # a multi-byte character split over byte tokens is held back until complete
    ids = tokenizer.encode("🌍")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add(i) for i in ids] == [""] * (len(ids) - 1) + ["🌍"]
