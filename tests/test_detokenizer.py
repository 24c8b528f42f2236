"""IncrementalDetokenizer: streamed deltas, UTF-8 splits, stop strings, hold-back."""

from __future__ import annotations

import contextlib
import json
import random

import pytest

from shoal.engine.detokenizer import IncrementalDetokenizer, StopMatch
from tiny_models import _CORPUS, make_tokenizer

FFFD = "\ufffd"


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def stream(tok, ids, prompt=(), *, every=1, **kw):
    """Feed `ids` one by one, taking a delta every `every` tokens; (deltas, detok, stop match)."""
    d = IncrementalDetokenizer(tok, list(prompt), **kw)
    deltas, match = [], None
    for i, t in enumerate(ids):
        match = d.add_token(t)
        if match is not None:
            break
        if (i + 1) % every == 0:
            deltas.append(d.take_delta(finished=False))
    deltas.append(d.take_delta(finished=True))
    return deltas, d, match


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


TEXTS = [
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog. ",
    "  leading spaces and   inner   runs  ",
    "def add(x, y):\n    return x + y\n\n\tif x:\n\t\tpass\n",
    "héllo naïve café über façade",
    "日本語のテキストと中文和한국어",
    "emoji 🙂 ok 😀🎉👍🏽 family 👨‍👩‍👧 flag 🇫🇷!",
    "mixed: a🙂b😀c日d\n",
    "🙂",
    "<|im_start|>assistant\nThe answer is 42.<|im_end|>",
    "before<|endoftext|>after <|im_end|>",
    "<think>reasoning goes here</think> and then the answer.",
    "",
]

CHAT_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("every", [1, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_joined_deltas_equal_decode(tok, text, skip, every):
    ids = encode(tok, text)
    for prompt in ((), encode(tok, CHAT_PROMPT), encode(tok, "Paris 🙂 is ")):
        deltas, d, match = stream(tok, ids, prompt, every=every, skip_special_tokens=skip)
        expected = tok.decode(ids, skip_special_tokens=skip)
        assert match is None
        assert "".join(deltas) == expected
        assert d.text == expected


def test_special_tokens_skipped_or_kept(tok):
    ids = encode(tok, "a<|im_end|>b")
    assert 2 in ids
    assert "".join(stream(tok, ids, skip_special_tokens=True)[0]) == "ab"
    assert "".join(stream(tok, ids, skip_special_tokens=False)[0]) == "a<|im_end|>b"


def test_split_emoji_never_yields_replacement_char(tok):
    text = "emoji 🙂 ok 😀🎉 日本語 👍🏽"
    ids = encode(tok, text)
    # The byte-level BPE really does split these characters across tokens.
    assert any(FFFD in tok.decode([i]) for i in ids)
    deltas, d, _ = stream(tok, ids)
    assert all(FFFD not in x for x in deltas)
    assert "".join(deltas) == text


def test_incomplete_char_released_as_decode_shows_it_on_finish(tok):
    ids = encode(tok, "ok 😀🎉")
    for cut in range(1, len(ids) + 1):
        part = ids[:cut]
        d = IncrementalDetokenizer(tok, [])
        for t in part:
            d.add_token(t)
        mid = d.take_delta()
        assert FFFD not in mid
        assert mid + d.take_delta(finished=True) == tok.decode(part)


def test_stop_string_split_across_tokens(tok):
    ids = encode(tok, "Hello, world! Wonderful World of foxes")
    # "World" is tokenized as " ", "W", "o", "rld": spread over several tokens.
    deltas, d, match = stream(tok, ids, stop=["World"])
    assert match == StopMatch(stop="World", offset=len("Hello, world! Wonderful "))
    assert "".join(deltas) == d.text == "Hello, world! Wonderful "


def test_stop_in_middle_of_token_drops_rest_of_token(tok):
    ids = encode(tok, "The quick brown fox jumps")
    assert " fox" in [tok.decode([i]) for i in ids]
    deltas, d, match = stream(tok, ids, stop=["fo"])
    assert match.stop == "fo"
    assert "".join(deltas) == d.text == "The quick brown "
    # The stop can also start inside a token and end inside a later one.
    deltas, _, match = stream(tok, ids, stop=["x ju"])
    assert match.stop == "x ju" and "".join(deltas) == "The quick brown fo"


def test_include_stop_str_in_output(tok):
    ids = encode(tok, "The quick brown fox jumps")
    deltas, d, match = stream(tok, ids, stop=["own f"], include_stop_str_in_output=True)
    assert match.stop == "own f"
    assert "".join(deltas) == d.text == "The quick brown f"
    # Text after the stop string within the same token is still dropped.
    deltas, _, _ = stream(tok, ids, stop=["qu"], include_stop_str_in_output=True)
    assert "".join(deltas) == "The qu"


def test_tokens_after_stop_are_ignored(tok):
    d = IncrementalDetokenizer(tok, [], stop=["fox"])
    match = None
    for t in encode(tok, "The quick brown fox"):
        match = d.add_token(t) or match
    assert match is not None and d.stopped and d.stop_match is match
    for t in encode(tok, " jumps over"):
        assert d.add_token(t) is None
    assert d.take_delta() == "The quick brown "  # nothing held once stopped
    assert d.take_delta(finished=True) == ""


def test_hold_back_prefix_of_stop(tok):
    text = "Hello, world! Wonderful World"
    ids = encode(tok, text)
    stop_at = text.index("World")
    d = IncrementalDetokenizer(tok, [], stop=["World"])
    released = ""
    for t in ids:
        if d.add_token(t) is not None:
            break
        released += d.take_delta()
        # No delta ever carries a piece of the "World" that later matches.
        assert len(released) <= stop_at
    assert released + d.take_delta(finished=True) == "Hello, world! Wonderful "
    # "Wo" followed by "nder": released as soon as it can no longer be "World".
    d = IncrementalDetokenizer(tok, [], stop=["World"])
    seen = []
    for t in encode(tok, "Hello, world! Wonderful"):
        assert d.add_token(t) is None
        seen.append((tok.decode([t]), d.take_delta()))
    i = [tt for tt, _ in seen].index("W")
    assert seen[i - 1] == (" ", " ")
    assert seen[i] == ("W", "")  # "W" could start "World": held
    assert seen[i + 1] == ("on", "Won")  # "Won" cannot: released at once
    assert "".join(x for _, x in seen) + d.take_delta(finished=True) == "Hello, world! Wonderful"


class CharTok:
    """One token per character; enough tokenizer for the bookkeeping (not a transformers one)."""

    all_special_ids: list[int] = []

    def convert_ids_to_tokens(self, ids):
        return chr(ids) if isinstance(ids, int) else [chr(i) for i in ids]

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens)


def test_hold_back_releases_exactly_what_cannot_be_a_stop():
    stop = "Hello World"
    d = IncrementalDetokenizer(CharTok(), [], stop=[stop])
    out = ""
    text = "say Hel, then Hello Wor, then Hello World!"
    for i, ch in enumerate(text):
        if d.add_token(ord(ch)):
            break
        out += d.take_delta()
        # Everything is released except the longest tail that is a prefix of the stop.
        so_far = text[: i + 1]
        held = max(k for k in range(len(stop)) if so_far.endswith(stop[:k]))
        assert out == so_far[: len(so_far) - held]
    assert out + d.take_delta(finished=True) == "say Hel, then Hello Wor, then "


def test_held_text_released_on_finish(tok):
    for reason_text in ("Hello, wor", "Hello, world! Wo", "say He"):
        ids = encode(tok, reason_text)
        d = IncrementalDetokenizer(tok, [], stop=["world!?", "Wonder", "Help"])
        for t in ids:
            assert d.add_token(t) is None
        partial = d.take_delta()
        assert d.num_pending_chars > 0  # something was held back
        assert partial + d.take_delta(finished=True) == reason_text
        assert d.text == reason_text


def test_multiple_stops_earliest_wins(tok):
    ids = encode(tok, "The quick brown fox jumps over the lazy dog")
    deltas, _, match = stream(tok, ids, stop=["lazy", "fox", "quick brown"])
    assert match.stop == "quick brown" and "".join(deltas) == "The "
    deltas, _, match = stream(tok, ids, stop=["dog", "jumps"])
    assert match.stop == "jumps" and "".join(deltas) == "The quick brown fox "
    # Overlapping stops: the one the text completes first wins, however it was tokenized.
    for stops, expect in ((["brown fox", "own"], "The quick br"), (["own", "brown fox"], "The quick br"),
                          (["quick brown", "brown"], "The "), (["k b", "quick"], "The ")):
        for every in (1, 2):
            deltas, _, _ = stream(tok, ids, stop=stops, every=every)
            assert "".join(deltas) == expect, stops


def test_stop_on_special_token_text_when_not_skipped(tok):
    ids = encode(tok, "answer<|im_end|>junk")
    deltas, _, match = stream(tok, ids, stop=["<|im_end|>"], skip_special_tokens=False)
    assert match.stop == "<|im_end|>" and "".join(deltas) == "answer"
    # Skipped special tokens are not text, so they cannot match.
    deltas, _, match = stream(tok, ids, stop=["<|im_end|>"], skip_special_tokens=True)
    assert match is None and "".join(deltas) == "answerjunk"


def test_stop_right_after_split_emoji(tok):
    ids = encode(tok, "ok 😀🎉 done. more")
    deltas, _, match = stream(tok, ids, stop=["🎉 d"])
    assert match.stop == "🎉 d" and "".join(deltas) == "ok 😀"
    assert all(FFFD not in x for x in deltas)


def test_check_stop_false_skips_matching(tok):
    d = IncrementalDetokenizer(tok, [], stop=["fox"])
    ids = encode(tok, "The quick brown fox jumps, fox")
    n_first = ids.index(encode(tok, " fox")[0]) + 1
    for t in ids[:n_first]:
        assert d.add_token(t, check_stop=False) is None
    match = None
    for t in ids[n_first:]:
        match = d.add_token(t) or match
    assert match.stop == "fox"
    assert d.take_delta(finished=True) == "The quick brown fox jumps, "


def test_fork_is_independent(tok):
    d = IncrementalDetokenizer(tok, [], stop=["World"])
    for t in encode(tok, "Hello 🙂 W"):
        d.add_token(t)
    e = d.fork()
    for t in encode(tok, "orld"):
        d.add_token(t)
    for t in encode(tok, "onder"):
        e.add_token(t)
    assert d.take_delta(finished=True) == "Hello 🙂 "
    assert e.take_delta(finished=True) == "Hello 🙂 Wonder"


def test_accepts_numpy_scalar_ids(tok):
    np = pytest.importorskip("numpy")
    ids = encode(tok, "Hello 🙂 world")
    deltas, _, _ = stream(tok, [np.int64(i) for i in ids], np.array(encode(tok, CHAT_PROMPT)))
    assert "".join(deltas) == "Hello 🙂 world"


def test_random_ids_and_stops_match_bruteforce(tok):
    """Random token ids (invalid UTF-8 included) and stops: same as decoding all at once."""
    rng = random.Random(0)
    vocab = len(tok)
    for trial in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        skip = rng.random() < 0.7
        full = tok.decode(ids, skip_special_tokens=skip)
        stops = []
        for _ in range(rng.randrange(0, 3)):
            if full and rng.random() < 0.8:
                a = rng.randrange(len(full))
                stops.append(full[a : a + rng.randrange(1, 6)])
            else:
                stops.append("".join(rng.choice("ab ") for _ in range(3)))
        include = rng.random() < 0.5
        # Brute force: the first stop the character stream completes (ties: earliest start).
        best = min(
            ((full.find(s) + len(s), full.find(s), s) for s in stops if s and s in full),
            default=None,
        )
        expected = full if best is None else full[: best[0] if include else best[1]]
        deltas, d, match = stream(
            tok, ids, every=rng.choice([1, 2, 5]), stop=stops, include_stop_str_in_output=include,
            skip_special_tokens=skip,
        )
        assert "".join(deltas) == d.text == expected, (trial, ids, stops)
        # (A stop can complete only at the finish flush, so look at stop_match.)
        assert (d.stop_match is None) == (best is None)
        assert best is None or d.stop_match.stop == best[2]


# ------------------------------------------------------------ SentencePiece-style


def _metaspace_unigram():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], unk_token="<unk>", show_progress=False
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _llama_style_bpe():
    """Llama-2 style: "▁" for spaces, byte fallback tokens, decoder strips one leading space."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    trainer = trainers.BpeTrainer(vocab_size=250, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(_CORPUS * 20, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("make", [_metaspace_unigram, _llama_style_bpe])
def test_sentencepiece_leading_space_after_prompt(make):
    sp = make()
    dec = lambda ids: sp.decode(ids, skip_special_tokens=True)  # noqa: E731
    full = encode(sp, "The capital of France is Paris, naïve 🙂 café. ok 😀 日本")
    full_text = dec(full)
    prompt = encode(sp, "The capital of France is")
    out = full[len(prompt) :]
    assert full[: len(prompt)] == prompt
    # Decoded alone, the output loses its leading space; after the prompt it keeps it.
    assert not dec(out).startswith(" ")
    deltas, d, _ = stream(sp, out, prompt)
    expected = full_text[len(dec(prompt)) :]
    assert expected.startswith(" Paris, naïve 🙂 café. ok ")  # (the unigram one has no 😀: <unk>)
    assert "".join(deltas) == d.text == expected
    assert all(FFFD not in x for x in deltas)
    # Every split point: prompt text + streamed output text == full text.
    for cut in range(len(full)):
        prompt_text = dec(full[:cut])
        if not full_text.startswith(prompt_text):
            continue  # a prompt ending inside a byte-fallback character
        deltas, _, _ = stream(sp, full[cut:], full[:cut], every=2)
        assert prompt_text + "".join(deltas) == full_text, cut
    # Without a prompt the output is what decode gives.
    assert "".join(stream(sp, full)[0]) == full_text


def test_sentencepiece_byte_fallback_split_char():
    sp = _llama_style_bpe()
    ids = encode(sp, "ok 😀 done")
    assert "<0xF0>" in sp.convert_ids_to_tokens(ids)
    deltas, _, _ = stream(sp, ids, encode(sp, "say"))
    assert all(FFFD not in x for x in deltas)
    assert "".join(deltas) == " ok 😀 done"
    deltas, _, match = stream(sp, ids, encode(sp, "say"), stop=["😀 d"])
    assert match.stop == "😀 d" and "".join(deltas) == " ok "


def test_no_torch_import():
    """No heavy import at module level; tokenizers only inside the DecodeStream window (its tokenizer loaded it)."""
    import ast
    from pathlib import Path

    import shoal.engine.detokenizer as mod

    def imports(nodes):
        names = set()
        for node in nodes:
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module.split(".")[0])
        return names

    tree = ast.parse(Path(mod.__file__).read_text())
    heavy = {"torch", "transformers", "tokenizers", "numpy"}
    assert not imports(tree.body) & heavy
    assert imports(ast.walk(tree)) & heavy == {"tokenizers"}


# ------------------------------------------------------------ the window: DecodeStream, and the hand-written one
#
# Fast tokenizers go through tokenizers' DecodeStream (`_StreamWindow`); the hand-written window
# (`_TokenWindow`) stays for any other tokenizer. Both must give, token by token, what decoding
# every prefix of the output gives, on the default model's tokenizer, the tiny models' tokenizers
# (every family's tiny model uses `make_tokenizer`, the vision ones with added special tokens),
# and SentencePiece-style ones.

MULTIBYTE_TEXTS = [
    *TEXTS,
    "Ça va? Déjà vu — naïveté, coöperate, Ångström, ß, œuvre, Ελληνικά, русский",
    "中文文本：你好，世界！繁體字與簡體字。日本語：こんにちは。한국어: 안녕하세요",
    "🙂🙃😀😁🎉👍🏽👩🏾‍💻🧑‍🤝‍🧑🏳️‍🌈 🇯🇵🇺🇸 ∑∫√∞ ≠ ≤ ≥ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟘𝟙",
    "<|im_start|>user\nhi 🙂<|im_end|>\n<|im_start|>assistant\nhello 😀 世界<|im_end|>",
    "<|vision_start|><|image_pad|><|vision_end|> caption <image> <row_1_col_1> ok",
]
PROMPTS = ["", CHAT_PROMPT, "Paris 🙂 is ", "日本"]
FAMILIES = ["default", "byte-level", "byte-level-vl", "byte-level-idefics3", "metaspace-unigram", "llama-byte-fallback"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_tok(request):
    name = request.param
    if name == "default":
        from shoal.model.gguf_loader import GGUFFileReader, build_tokenizer, read_metadata

        return build_tokenizer(read_metadata(GGUFFileReader(request.getfixturevalue("default_gguf_path"))))
    if name.startswith("byte-level"):
        from tiny_models import IDEFICS3_TOKENS, VL_TOKENS

        t = make_tokenizer()
        extra = {"byte-level-vl": VL_TOKENS, "byte-level-idefics3": IDEFICS3_TOKENS}.get(name)
        if extra:
            t.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *extra]})
        return t
    return {"metaspace-unigram": _metaspace_unigram, "llama-byte-fallback": _llama_style_bpe}[name]()


@contextlib.contextmanager
def hand_written_window(monkeypatch):
    """A context in which every detokenizer uses the hand-written window."""
    from shoal.engine import detokenizer

    with monkeypatch.context() as m:
        m.setattr(detokenizer._StreamWindow, "fits", staticmethod(lambda tokenizer: False))
        yield


def trace(tok, ids, prompt=(), *, every=1, fork_at=None, fork_ids=(), **kw):
    """Everything a caller sees, token by token: (stop match, delta) per token, the finish, the text;
    with `fork_at`, the same for a fork made before token `fork_at` and fed `fork_ids`."""
    def run(d, ids, fork_at=None):
        out = []
        for i, t in enumerate(ids):
            if i == fork_at:
                out.append(("fork", run(d.fork(), fork_ids)))
            m = d.add_token(t)
            out.append(("match", m))
            if m is not None:
                break
            if (i + 1) % every == 0:
                out.append(("delta", d.take_delta()))
        out.append(("finish", d.take_delta(finished=True)))
        out.append(("text", d.text))
        return out

    d = IncrementalDetokenizer(tok, list(prompt), **kw)
    return type(d._window).__name__, run(d, ids, fork_at)


def prefix_decode_deltas(tok, ids, prompt, skip):
    """The reference: after each token, the text of decoding the prompt and every output token so far,
    less the prompt's text, as long as it does not end in an incomplete character; then the finish."""
    base = tok.decode(prompt, skip_special_tokens=skip)
    shown, deltas = "", []
    for k in range(1, len(ids) + 1):
        text = tok.decode(prompt + ids[:k], skip_special_tokens=skip)
        assert text.startswith(base)
        text = text[len(base) :]
        if len(text) > len(shown) and not text.endswith(FFFD):
            assert text.startswith(shown)
            deltas.append(text[len(shown) :])
            shown = text
        else:
            deltas.append("")
    full = tok.decode(prompt + ids, skip_special_tokens=skip)[len(base) :]
    return deltas, full[len(shown) :]


def test_fast_tokenizers_use_decode_stream(family_tok):
    from shoal.engine.detokenizer import _StreamWindow, _TokenWindow

    assert type(IncrementalDetokenizer(family_tok, [])._window) is _StreamWindow

    class OwnDecode(type(family_tok)):
        def decode(self, *a, **kw):  # a tokenizer that changes decode: its text is not DecodeStream's
            return super().decode(*a, **kw)

    assert not _StreamWindow.fits(OwnDecode.__new__(OwnDecode))
    # A tokenizer that is not one of transformers' fast ones: the hand-written window.
    assert type(IncrementalDetokenizer(CharTok(), [])._window) is _TokenWindow


@pytest.mark.parametrize("skip", [True, False])
def test_deltas_equal_decode_of_prefixes(family_tok, skip, monkeypatch):
    tok = family_tok
    split = 0
    for text in MULTIBYTE_TEXTS:
        ids = encode(tok, text)
        split += any(FFFD in tok.decode([i]) for i in ids)
        for prompt_text in PROMPTS:
            prompt = encode(tok, prompt_text)
            deltas, rest = prefix_decode_deltas(tok, ids, prompt, skip)
            expected = [x for d in deltas for x in (("match", None), ("delta", d))]
            expected += [("finish", rest), ("text", "".join(deltas) + rest)]
            assert trace(tok, ids, prompt, skip_special_tokens=skip) == ("_StreamWindow", expected), (text, prompt_text)
            with hand_written_window(monkeypatch):
                assert trace(tok, ids, prompt, skip_special_tokens=skip) == ("_TokenWindow", expected)
    # Tokens that split a UTF-8 character were among them (unless the vocabulary has none: the unigram one).
    assert split or not any(FFFD in tok.decode([i]) for i in range(len(tok)))


def test_long_stream_cut_inside_a_character(family_tok):
    """Past the ids the stream window keeps (it drops old ones), a finish inside a character still
    releases what decode shows."""
    tok = family_tok
    ids = encode(tok, "日本語のテキスト 🙂 emoji 👍🏽 naïve 🎉 " * 12)
    prompt = encode(tok, "say")
    assert len(ids) > 150
    inside = 0
    for cut in range(len(ids) - 12, len(ids) + 1):
        if not monotone(tok, prompt + ids[:cut]):
            continue  # byte fallback: decode takes back the run's earlier characters (see below)
        text = tok.decode(prompt + ids[:cut], skip_special_tokens=True)  # (the unigram one has <unk>s)
        expected = text[len(tok.decode(prompt, skip_special_tokens=True)) :]
        inside += expected.endswith(FFFD)
        deltas, d, _ = stream(tok, ids[:cut], prompt)
        assert "".join(deltas) == d.text == expected, cut
    assert inside or not any(FFFD in tok.decode([i]) for i in ids)


def first_stop(full, stops, include):
    """`full` cut at the stop string the character stream completes first (ties: the earliest start)."""
    best = min(((full.find(s) + len(s), full.find(s), s) for s in stops if s in full), default=None)
    return (full, None) if best is None else (full[: best[0] if include else best[1]], best[2])


STOPS = [("World",), ("fox", "Paris"), ("🎉 d", "本語", "é"), ("<|im_end|>", "\n"), ("ok", "世界", "🙂")]


@pytest.mark.parametrize("include", [False, True])
def test_stops_hold_back_and_fork_same_in_both_windows(family_tok, include, monkeypatch):
    """Stop strings (within and across tokens, multibyte ones too), the held-back tail and a fork
    mid-stream: the same deltas from both windows, and the text decode gives, cut at the first stop."""
    tok = family_tok
    fork_ids = encode(tok, " 🙂 forked, 日本 ok")
    for text in MULTIBYTE_TEXTS:
        ids = encode(tok, text)
        full = tok.decode(ids, skip_special_tokens=True)
        # Stops from the text itself too: pieces a few characters long, at a few places.
        own = tuple(full[a : a + 3] for a in range(1, len(full), max(1, len(full) // 3)))
        # Fork halfway, inside a character too where decode allows it (byte-level: it never takes one back).
        half = next(k for k in range(len(ids) // 2, -1, -1) if monotone(tok, ids[:k] + fork_ids))
        for stops in [*STOPS, own]:
            for every, fork_at in ((1, None), (3, half)):
                kw = dict(stop=stops, include_stop_str_in_output=include, every=every, fork_at=fork_at, fork_ids=fork_ids)
                window, got = trace(tok, ids, **kw)
                with hand_written_window(monkeypatch):
                    assert trace(tok, ids, **kw) == ("_TokenWindow", got), (text, stops)
                assert window == "_StreamWindow"
                expected, stop = first_stop(full, stops, include)
                deltas = [x for k, x in got if k in ("delta", "finish")]
                assert "".join(deltas) == got[-1][1] == expected, (text, stops)
                assert [m.stop for k, m in got if k == "match" and m is not None] == ([stop] if stop else [])
                # Hold-back: no delta ever carries text past what ends up in the output.
                released = ""
                for x in deltas:
                    released += x
                    assert expected.startswith(released)
                forks = [x for k, x in got if k == "fork"]
                if forks:
                    fork_full = tok.decode(ids[:fork_at] + fork_ids, skip_special_tokens=True)
                    fork_expected, _ = first_stop(fork_full, stops, include)
                    parent_before = "".join(x for k, x in got[: got.index(("fork", forks[0]))] if k == "delta")
                    fork_deltas = "".join(x for k, x in forks[0] if k in ("delta", "finish"))
                    assert parent_before + fork_deltas == forks[0][-1][1] == fork_expected, (text, stops)


def monotone(tok, ids):
    """Whether decoding the ids one more at a time never takes back a character it showed (byte-fallback
    runs can: see below); text ending inside a character is held back, so it may, unless it is the last."""
    shown = ""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k])
        if k < len(ids) and text.endswith(FFFD):
            continue
        if not text.startswith(shown):
            return False
        shown = text
    return True


def test_random_ids_same_in_both_windows(family_tok, monkeypatch):
    """Random ids (invalid UTF-8, special tokens), stops and forks: both windows give the same, and
    the text is decode's cut at the first stop (where decode never takes back a character)."""
    tok = family_tok
    rng = random.Random(0)
    vocab = len(tok)
    checked = 0
    for trial in range(150):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        full = tok.decode(ids)
        starts = [rng.randrange(len(full) or 1) for _ in range(rng.randrange(3))]
        stops = tuple(full[a : a + rng.randrange(1, 5)] for a in starts)
        include = rng.random() < 0.5
        kw = dict(stop=stops, skip_special_tokens=False, every=rng.choice([1, 2]), include_stop_str_in_output=include)
        window, got = trace(tok, ids, **kw)
        assert window == "_StreamWindow"
        if not monotone(tok, ids):
            continue
        checked += 1
        with hand_written_window(monkeypatch):
            assert trace(tok, ids, **kw) == ("_TokenWindow", got), (trial, ids, stops)
        expected, _ = first_stop(full, stops, include)
        assert "".join(x for k, x in got if k in ("delta", "finish")) == got[-1][1] == expected, (trial, ids, stops)
        # After a prompt, with a fork halfway that goes on with the ids backwards.
        half = len(ids) // 2
        if monotone(tok, prompt + ids) and monotone(tok, prompt + ids[:half] + ids[::-1]):
            kw = dict(skip_special_tokens=False, fork_at=half, fork_ids=ids[::-1])
            _, got = trace(tok, ids, prompt, **kw)
            with hand_written_window(monkeypatch):
                assert trace(tok, ids, prompt, **kw) == ("_TokenWindow", got), (trial, prompt, ids)
    assert checked > 20


def test_byte_fallback_character_taken_back_by_decode(monkeypatch):
    """Byte-fallback bytes make "日" (sent), then a stray byte makes decode show the whole run as U+FFFD:
    what was sent stays sent, and the text goes on with as many characters as decode shows."""
    sp = _llama_style_bpe()
    ids = sp.convert_tokens_to_ids(["<0xE6>", "<0x97>", "<0xA5>", "<0x97>", "b", "▁o", "k"])
    assert sp.decode(ids[:3]) == "日" and sp.decode(ids) == FFFD * 4 + "b ok"
    deltas = ["", "", "日", "", FFFD * 3 + "b", " o", "k"]
    expected = [x for d in deltas for x in (("match", None), ("delta", d))]
    expected += [("finish", ""), ("text", "日" + FFFD * 3 + "b ok")]
    assert trace(sp, ids) == ("_StreamWindow", expected)
    with hand_written_window(monkeypatch):
        assert trace(sp, ids) == ("_TokenWindow", expected)


def test_ids_outside_the_vocabulary_give_no_text(family_tok):
    """A model's vocabulary can be larger than its tokenizer's: such ids add nothing, even inside a split character."""
    tok = family_tok
    ids = encode(tok, "ok 😀🎉 日本語 done")
    out = [len(tok) + 7]
    for t in ids:
        out += [t, len(tok) + 3]
    deltas, d, _ = stream(tok, out, encode(tok, "say"))
    assert "".join(deltas) == "".join(stream(tok, ids, encode(tok, "say"))[0])
    assert FFFD not in "".join(deltas)

